"""Tree verify on the target: one forward over a draft tree, then cache compaction.

A tree is [root] + nodes, node i hanging under parents[i] (-1 = the root, which is
the pending token). In one target forward every node must
- sit at the position of its depth (root at the cache offset, a depth-d node at
  offset + d), and
- attend to the committed context and to exactly its ancestors and itself.
mlx-lm models compute positions (rope offset = cache offset, then consecutive) and
masks internally, so for the duration of the forward `tree_attention` swaps in
- a rope that moves tokens into the batch axis, where mx.fast.rope takes one
  offset per row: every token gets its own position;
- a mask builder (the model module's `create_attention_mask`) that returns the
  tree mask over [context keys | tree keys], windowed for sliding layers;
and always restores both. Recurrent (DeltaNet) layers cannot run a tree; hybrid
targets verify a chain instead (see engines/methods/eagle3.py).

After acceptance, `compact` keeps the root and the accepted path in every
attention cache, contiguous at the positions they were computed for.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from engines.runtime.cache import RollbackError
from engines.runtime.hidden import decoder
from engines.runtime.patches import attention_mask, rope
from engines.runtime.sampling import drafts_then


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of every node (children of the root: 1); parents come before children."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def depths_and_ancestors(parents: list[int]) -> tuple[list[int], mx.array]:
    """For [root] + nodes: depth of each (root 0) and the [T, T] ancestor-or-self mask."""
    T = len(parents) + 1
    depth = [0] * T
    anc = [[False] * T for _ in range(T)]
    anc[0][0] = True
    for i, p in enumerate(parents, start=1):
        p = p + 1  # parents index nodes from 0, with -1 for the root
        assert 0 <= p < i, f"node {i - 1}: parent {p - 1} must come before it"
        depth[i] = depth[p] + 1
        anc[i] = list(anc[p])
        anc[i][i] = True
    return depth, mx.array(anc)


class _TreeRope(nn.Module):
    """Rope with one position per token: [B=1, H, T, D] -> rows of the batch axis."""

    def __init__(self, rope, depths: mx.array):
        super().__init__()
        self.rope, self.depths = rope, depths

    def __call__(self, x, offset=0):
        if x.shape[2] != self.depths.shape[0]:
            return self.rope(x, offset=offset)
        y = self.rope(x.transpose(2, 1, 0, 3), offset=offset + self.depths)  # [T, H, 1, D], offset per row
        return y.transpose(2, 1, 0, 3)


def _tree_mask_fn(depths: mx.array, ancestors: mx.array):
    def create_attention_mask(h, cache=None, window_size=None, return_array=False):
        n = h.shape[1]
        assert n == ancestors.shape[0], "tree forward with an unexpected length"
        offset = cache.offset if cache is not None else 0
        context = offset
        if isinstance(cache, RotatingKVCache):
            context = min(cache.max_size - 1, offset)  # what its multi-token update keeps
            window_size = window_size or cache.max_size
        qpos = offset + depths  # [T]
        kpos = offset - context + mx.arange(context)  # [C]
        ctx = mx.ones((n, context), dtype=mx.bool_)
        if window_size:
            ctx = (qpos[:, None] - kpos[None]) < window_size
        return mx.concatenate([ctx, ancestors], axis=1)  # [T, C + T]
    return create_attention_mask


@contextmanager
def tree_attention(model: nn.Module, parents: list[int]):
    """Within the block, a forward over [root] + nodes runs as a tree (see module doc); the
    swaps themselves are engines/runtime/patches.py `rope` and `attention_mask`."""
    depth, ancestors = depths_and_ancestors(parents)
    depths = mx.array(depth)
    attns = [layer.self_attn for layer in decoder(model).layers if hasattr(layer, "self_attn")]
    module = sys.modules[type(decoder(model)).__module__]
    mask = _tree_mask_fn(depths, ancestors)
    with rope(attns, lambda r: _TreeRope(r, depths)), attention_mask(module, lambda _: mask):
        yield depth


def check_tree_capable(caches: list) -> None:
    if any(isinstance(c, ArraysCache) for c in caches):
        raise RollbackError("recurrent layers cannot verify a tree: one state cannot hold several branches")


def compact(caches: list, tree_size: int, keep: list[int]) -> None:
    """After a tree forward of tree_size tokens: keep entries `keep` (increasing tree
    indices, root first) contiguous at the end of every attention cache."""
    idx = mx.array(keep)
    in_place = keep == list(range(len(keep)))  # root and first children kept (or the root alone): a trim
    for c in caches:
        start = c.offset - tree_size
        if isinstance(c, RotatingKVCache):
            _compact_rotating(c, tree_size, idx)
        elif isinstance(c, (KVCache, QuantizedKVCache)):
            if not in_place:  # two gathers a layer, only where entries move
                parts = [(c.keys, c.values)] if isinstance(c, KVCache) else list(zip(c.keys, c.values))
                for keys, values in parts:
                    keys[..., start: start + len(keep), :] = keys[..., start + idx, :]
                    values[..., start: start + len(keep), :] = values[..., start + idx, :]
            c.offset = start + len(keep)
        else:
            raise RollbackError(f"cannot compact a {type(c).__name__} after a tree verify")


def _compact_rotating(c: RotatingKVCache, tree_size: int, idx: mx.array) -> None:
    # A multi-token update left the buffer in temporal order: [context | tree].
    if c._idx != c.keys.shape[2]:
        raise RollbackError("sliding window not in the layout a tree forward leaves")
    context = c.keys.shape[2] - tree_size
    c.keys = mx.concatenate([c.keys[..., :context, :], c.keys[..., context + idx, :]], axis=2)
    c.values = mx.concatenate([c.values[..., :context, :], c.values[..., context + idx, :]], axis=2)
    c.offset = c.offset - tree_size + idx.shape[0]
    c._idx = c.keys.shape[2]


def accept_tree_greedy(tokens: list[int], parents: list[int], choices: list[int]) -> tuple[list[int], int]:
    """Walk from the root taking the child equal to the target's choice at each node.

    choices[j] is the target's argmax at tree index j (0 = root). Returns the accepted
    node indices (0-based into `tokens`) and the bonus token at the last accepted node.
    """
    children: dict[int, dict[int, int]] = {}
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children.setdefault(p, {})[t] = i
    path, here = [], -1
    while True:
        nxt = children.get(here, {}).get(choices[here + 1])
        if nxt is None:
            return path, choices[here + 1]
        path.append(nxt)
        here = nxt


def accept_tree_on_device(tokens: mx.array, parents: mx.array, choices: mx.array, depth: int,
                          forced: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """accept_tree_greedy with fixed shapes and no host read, for a tree of [root] + N nodes.

    tokens [N] node ids at tree indices 1..N; parents [N] the tree index of each node's parent (0 =
    the root); choices [N + 1] the target's choice at each tree index; depth: the deepest node's.
    Returns the outcome [1 + depth + 1] (n accepted, then the target's choices along the accepted
    path: the first n + 1 are emitted, the accepted nodes' tokens and the bonus) and the path
    [depth + 1] (tree indices: the root, then the accepted node at each depth; the root past n).
    forced ([1] int32, engines/runtime/forced.py): accept down the first child at each depth, at most that
    many nodes, whatever the target chose; the emitted tokens are then the nodes' own, and the
    target's choice at the last one."""
    tokens, parents = tokens.astype(mx.int32), parents.astype(mx.int32)
    choices = choices.astype(mx.int32)
    if forced is None:
        agrees = tokens == mx.take(choices, parents)  # [N]: the node is its parent's choice
    else:
        agrees = mx.ones(tokens.shape, dtype=mx.bool_)
    here = mx.array(0, dtype=mx.int32)
    n = mx.zeros((1,), dtype=mx.int32)
    path = [here[None]]
    for level in range(depth):  # the walk: the child of `here` that agrees (siblings carry distinct ids)
        child = agrees & (parents == here)
        found = mx.any(child) if forced is None else mx.any(child) & (level < forced[0])
        here = mx.where(found, mx.argmax(child).astype(mx.int32) + 1, here)
        n = n + found.astype(mx.int32)  # once a level has no agreeing child, none below has either
        path.append(mx.where(found, here, 0)[None])
    path = mx.concatenate(path)  # [depth + 1]
    if forced is None:
        return mx.concatenate([n, mx.take(choices, path)]), path
    final = mx.take(choices, mx.take(path, n))  # [1] the target's choice at the last accepted node
    nodes = mx.take(mx.concatenate([mx.zeros((1,), dtype=mx.int32), tokens]), path[1:])  # [depth]
    return mx.concatenate([n, drafts_then(nodes, final, n)]), path
