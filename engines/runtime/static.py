"""Device-resident decoding state: caches of fixed capacity whose write position is a device value.

A StaticKVCache speaks mlx-lm's cache protocol (update_and_fetch, make_mask, offset) over K/V
buffers of `capacity` positions allocated once. Its position is an int32 device scalar, and
the attention mask is built in the graph from that position, so a call over T tokens has the
same shapes at every position: mx.compile traces it once per (T, capacity) and replays it.
Rollback is a new position: entries past it are masked now and overwritten by the next write,
so nothing is trimmed or copied, and a rollback to a position computed on the device (the
accepted count) needs no host read.

Sliding-window layers keep every position in their buffer and mask outside the window, which
is the same attention as mlx-lm's rotating buffer; recurrent (DeltaNet) and quantized KV caches
have no static form here (`static_layout` says why), and their targets run eagerly.

StaticState gathers one sequence's caches and their arrays in one list, the container a
compiled function declares as its implicit inputs and outputs (mx.compile's `inputs`/`outputs`):
it is filled anew at each reset, never replaced, so one compiled function serves every prompt.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from engines.kernels.live_attention import kernel_available as live_kernel_available
from engines.kernels.live_attention import live_attention
from engines.runtime.dispatch import attention_modules
from engines.runtime.hidden import decoder

CAPACITY_STEP = 512  # positions are allocated in buckets of this many: few capacities, few traces
DEFAULT_RESERVE = 1024  # positions a prefill leaves room for when its caller names none (calibration)


def capacity_for(positions: int) -> int:
    """The bucketed capacity that holds `positions`."""
    return -(-max(positions, 1) // CAPACITY_STEP) * CAPACITY_STEP


class StaticKVCache:
    """One attention layer's K/V over `capacity` positions; `window` masks all but the last
    `window` keys (a sliding-window layer). `arrays` holds the buffers and the position."""

    def __init__(self, arrays: dict, window: int | None = None, storage=None):
        self.arrays, self.window, self.storage = arrays, window, storage

    @staticmethod
    def empty(capacity: int, heads: int, head_dim: int, dtype, window: int | None = None, storage=None):
        shape = (1, heads, capacity, head_dim)
        kept = storage or dtype
        return StaticKVCache({"k": mx.zeros(shape, kept), "v": mx.zeros(shape, kept),
                              "pos": mx.array(0, dtype=mx.int32)}, window, storage)

    @property
    def capacity(self) -> int:
        return self.arrays["k"].shape[2]

    @property
    def offset(self) -> mx.array:
        return self.arrays["pos"]  # [] int32: rope takes an array offset, so positions never leave the device

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        # keys, values [1, H, T, D] written at pos; the whole buffer comes back, the mask hides what lies past.
        dtype = keys.dtype
        if self.storage is not None:
            keys, values = keys.astype(self.storage), values.astype(self.storage)
        a = self.arrays
        # A write past the buffer corrupts memory (MLX does not bound slice_update): clamped, so a round
        # queued past the budget (the loop reserves room for every round it reads) stays in bounds.
        start = mx.minimum(a["pos"], self.capacity - keys.shape[2])[None]
        a["k"] = mx.slice_update(a["k"], keys, start, axes=(2,))
        a["v"] = mx.slice_update(a["v"], values, start, axes=(2,))
        a["pos"] = a["pos"] + keys.shape[2]
        if self.storage is not None:
            return a["k"].astype(dtype), a["v"].astype(dtype)
        return a["k"], a["v"]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        """[n, capacity] bool: query i (at pos + i) sees key j when j <= pos + i (and within the window)."""
        q = self.arrays["pos"] + mx.arange(n)[:, None]
        k = mx.arange(self.capacity)[None]
        mask = k <= q
        window = window_size or self.window
        if window is not None:
            mask = mask & (k > q - window)
        return mask

    def set_position(self, pos: mx.array) -> None:
        self.arrays["pos"] = pos

    @property
    def state(self):
        return self.arrays["k"], self.arrays["v"]

    def is_trimmable(self) -> bool:
        return False  # a position is moved with set_position, never trimmed


@dataclass(frozen=True)
class Shape:
    """What a static cache of one layer needs: heads, head size, the window of a sliding layer."""

    heads: int
    head_dim: int
    window: int | None


def static_layout(model: nn.Module, kv: str = "native") -> list[Shape] | str:
    """Per layer, the shape of its static cache; or, where a layer has no static form, why."""
    if kv in ("q8", "q4"):
        return f"kv={kv}: a quantized KV cache has no static form here (use kv=native, float16 or bfloat16)"
    eager = make_prompt_cache(model)
    layers = decoder(model).layers
    shapes = []
    for i, c in enumerate(eager):
        if isinstance(c, (ArraysCache, QuantizedKVCache)) or not isinstance(c, (KVCache, RotatingKVCache)):
            return (f"layer {i} keeps a {type(c).__name__}: recurrent and quantized layers have no static form "
                    "here, so this target runs eagerly")
        attn = _attention(layers[i])
        if attn is None:
            return f"layer {i}: no attention module with k_proj to size a static cache from"
        shapes.append(Shape(_kv_heads(attn), _head_dim(attn),
                            c.max_size if isinstance(c, RotatingKVCache) else None))
    return shapes


def _attention(layer):
    for name in ("self_attn", "attention", "attn"):
        a = getattr(layer, name, None)
        if a is not None and hasattr(a, "k_proj"):
            return a
    return None


def _kv_heads(attn) -> int:
    for name in ("n_kv_heads", "num_key_value_heads", "n_kv"):
        if isinstance(getattr(attn, name, None), int):
            return getattr(attn, name)
    return attn.k_proj.weight.shape[0] // _head_dim(attn)


def _head_dim(attn) -> int:
    for name in ("head_dim", "hd"):
        if isinstance(getattr(attn, name, None), int):
            return getattr(attn, name)
    return attn.k_proj.weight.shape[0] // attn.n_kv_heads


class StaticState:
    """One sequence's static caches, rebuilt per capacity; `arrays` is the one container of
    their arrays that compiled functions read and write (module docstring)."""

    def __init__(self, shapes: list[Shape], dtype, storage=None):
        self.shapes, self.dtype, self.storage = shapes, dtype, storage
        self.caches: list[StaticKVCache] = []
        self.arrays: list[dict] = []

    def reset(self, capacity: int) -> None:
        """Fresh buffers of `capacity` positions at position 0 (the same container, refilled)."""
        self.caches = [StaticKVCache.empty(capacity, s.heads, s.head_dim, self.dtype, s.window, self.storage)
                       for s in self.shapes]
        self.arrays[:] = [c.arrays for c in self.caches]

    @property
    def capacity(self) -> int:
        return self.caches[0].capacity if self.caches else 0

    @property
    def position(self) -> mx.array:
        return self.caches[0].offset

    def set_position(self, pos: mx.array) -> None:
        """Every layer at `pos` ([] int32): a rollback, or a step past what a compiled call wrote."""
        for c in self.caches:
            c.set_position(pos)


class StaticTarget:
    """A loaded mlx-lm model over one sequence's static caches: forwards at device positions.

    prefill(prompt, reserve) sizes the buffers for the prompt and `reserve` more positions (the
    token budget and a last block), feeds the prompt eagerly (its length varies per prompt) and
    leaves the position after it. forward(ids) feeds T ids at the current position through a
    compiled function (one trace per T and capacity, counted in `traces`) and advances the
    position by T; set_position moves it anywhere (a rollback). `hidden_layers` as Target's.
    """

    def __init__(self, model: nn.Module, shapes: list[Shape], hidden_layers: tuple[int, ...] = (), kv: str = "native"):
        from engines.runtime.hidden import activation_dtype, vocab_size

        self.model, self.hidden_layers, self.kv = model, tuple(hidden_layers), kv
        storage = getattr(mx, kv) if kv in ("float16", "bfloat16") else None
        self.state = StaticState(shapes, activation_dtype(model), storage)
        self.vocab_size = vocab_size(model)
        self.traces = 0  # compiled traces made: one per (T, capacity) bucket, never one per step
        self.fed_tokens = 0
        self._compiled = mx.compile(self._run, inputs=self.state.arrays, outputs=self.state.arrays)
        # one-token attention on the live-length kernel where it runs (engines/kernels/live_attention.py)
        self._attention = attention_modules(model) if live_kernel_available() else []

    @property
    def attention(self) -> str:
        """Which one-token attention this target's static steps run, for the record."""
        return "live-length CUDA kernel" if self._attention else "masked sdpa over the buffer"

    def _run(self, ids: mx.array):
        # [T] ids at the caches' position -> logits [T, V] and hidden [1, T, n * H] (or a [0] placeholder).
        self.traces += 1  # runs only while mx.compile traces
        from engines.runtime.hidden import capture_hidden

        with live_attention(self._attention, StaticKVCache):
            if not self.hidden_layers:
                return self.model(ids[None], cache=self.state.caches)[0], mx.zeros((0,))
            with capture_hidden(self.model, self.hidden_layers) as sink:
                logits = self.model(ids[None], cache=self.state.caches)
        return logits[0], mx.concatenate(sink, axis=-1)

    def prefill(self, prompt, reserve: int = DEFAULT_RESERVE):
        """Fresh buffers for len(prompt) + reserve positions, the prompt fed (eagerly, in chunks);
        Forward(logits [V] at its last position, hidden [1, T, n * H] or None)."""
        from engines.runtime.target import PREFILL_CHUNK, Forward, as_ids

        ids = as_ids(prompt)
        self.state.reset(capacity_for(ids.shape[0] + reserve))
        if ids.shape[0] == 0:  # nothing to feed (a draft model behind a one-token prompt)
            return Forward(None, None)
        hidden = []
        for s in range(0, ids.shape[0], PREFILL_CHUNK):
            logits, h = self._run(ids[s: s + PREFILL_CHUNK])
            hidden.append(h)
            mx.eval(self.state.arrays, hidden)  # bound the lazy graph of long prompts
        self.traces -= -(-ids.shape[0] // PREFILL_CHUNK)  # eager calls, not traces
        self.fed_tokens += ids.shape[0]
        return Forward(logits[-1], mx.concatenate(hidden, axis=1) if self.hidden_layers else None)

    def forward(self, tokens):
        """Feed ids [T] at the current position (compiled); Forward(logits [T, V], hidden [1, T, n * H] or None)."""
        from engines.runtime.target import Forward, as_ids

        ids = as_ids(tokens)
        self.fed_tokens += ids.shape[0]
        logits, hidden = self._compiled(ids)
        return Forward(logits, hidden if self.hidden_layers else None)

    # The eager Target's verify / commit / mark / rewind, over positions: what calibration times.

    def verify(self, tokens):
        """forward(tokens), remembering where it started so commit(n) can keep its first n."""
        self._before = self.position
        return self.forward(tokens)

    def commit(self, n_keep: int) -> None:
        self.set_position(self._before + n_keep)

    def mark(self) -> mx.array:
        return self.position

    def rewind(self, mark: mx.array) -> None:
        self.set_position(mark)

    @property
    def cache(self) -> list:
        return self.state.caches

    @property
    def layout(self):
        from engines.runtime.cache import CacheLayout

        n = len(self.state.shapes)
        return CacheLayout(["StaticKVCache"] * n, n if self.state.storage is not None else 0,
                           0 if self.state.storage is not None else n, 0)

    @property
    def position(self) -> mx.array:
        return self.state.position

    def set_position(self, pos: mx.array) -> None:
        self.state.set_position(pos)

    def arrays(self) -> list:
        """Every array of the state (for mx.eval barriers)."""
        return self.state.arrays


def attention_shape(layer: nn.Module, window: int | None = None) -> Shape:
    """The static-cache Shape of one decoder layer of an mlx-lm model (a drafter's layer of the
    target's class, e.g. an MTP head's), as static_layout sizes the target's."""
    attn = _attention(layer)
    assert attn is not None, f"{type(layer).__name__} has no attention module with k_proj to size a static cache from"
    return Shape(_kv_heads(attn), _head_dim(attn), window)


# Tree verify over static caches (EAGLE-3's draft tree under execution=static): T tree tokens are
# written at T consecutive slots from the position, each rotated at its depth's position and seeing
# the context before the position and, of the tree's own slots, exactly its ancestors and itself.
# After acceptance `StaticTree.keep_path` moves the accepted path's K/V to the slots after the
# position, with the same shapes whatever was accepted.


def tree_mask(cache: StaticKVCache, depths: mx.array, ancestors: mx.array, window: int | None = None) -> mx.array:
    """[T, capacity] bool for T tree tokens written at the cache's position p: token i (at position
    p + depths[i]) sees every slot before p (within `window` of its position, for a sliding layer) and,
    of slots p..p+T-1, those ancestors[i] marks (ancestor-or-self, [T, T]); nothing past them."""
    pos, n = cache.offset, depths.shape[0]
    k = mx.arange(cache.capacity)[None]  # [1, C]
    rel = k - pos
    context = k < pos
    if window is not None:
        context = context & (pos + depths[:, None] - k < window)
    own = mx.take(ancestors, mx.clip(rel[0], 0, n - 1), axis=1)  # [T, C]: column rel of ancestors
    return mx.where((rel >= 0) & (rel < n), own, context)


@contextmanager
def static_tree_attention(model: nn.Module, depths: mx.array, ancestors: mx.array):
    """Within the block a forward of the T tokens runs as a tree over static caches (tree_mask,
    and engines/runtime/tree.py's per-token rope); depths [T] int32 and ancestors [T, T] may be traced arrays."""
    import sys

    from engines.runtime.patches import attention_mask, rope
    from engines.runtime.tree import _TreeRope

    attns = [layer.self_attn for layer in decoder(model).layers if hasattr(layer, "self_attn")]
    module = sys.modules[type(decoder(model)).__module__]

    def create_attention_mask(h, cache=None, window_size=None, return_array=False):
        assert isinstance(cache, StaticKVCache), "a static tree forward runs over StaticKVCache layers only"
        assert h.shape[1] == depths.shape[0], "tree forward with an unexpected length"
        return tree_mask(cache, depths, ancestors, window_size or cache.window)

    with rope(attns, lambda r: _TreeRope(r, depths)), attention_mask(module, lambda _: create_attention_mask):
        yield


class StaticTree:
    """Tree forwards over a StaticTarget's caches, compiled over its state like its forward: one trace
    per (T, capacity) for the forward, one per (path length, capacity) for keep_path (`traces`)."""

    def __init__(self, target: StaticTarget):
        self.target = target
        self.traces = 0
        arrays = target.state.arrays
        self._forward = mx.compile(self._run, inputs=arrays, outputs=arrays)
        self._keep = mx.compile(self._move, inputs=arrays, outputs=arrays)

    def _run(self, ids: mx.array, depths: mx.array, ancestors: mx.array):
        self.traces += 1  # runs only while mx.compile traces
        from engines.runtime.hidden import capture_hidden

        t = self.target
        with static_tree_attention(t.model, depths, ancestors):
            if not t.hidden_layers:
                return t.model(ids[None], cache=t.state.caches)[0], mx.zeros((0,))
            with capture_hidden(t.model, t.hidden_layers) as sink:
                logits = t.model(ids[None], cache=t.state.caches)
        return logits[0], mx.concatenate(sink, axis=-1)

    def forward(self, tokens: mx.array, depths: mx.array, ancestors: mx.array):
        """[root] + nodes, ids [T], at the position (root) and after it: depths [T] int32 (root 0),
        ancestors [T, T] bool (ancestor-or-self); Forward(logits [T, V], hidden [1, T, n * H] or None)
        in tree order. The position advances by T (keep_path then keeps the accepted path)."""
        from engines.runtime.target import Forward

        assert tokens.shape[0] == depths.shape[0] == ancestors.shape[0] == ancestors.shape[1], "tree shapes disagree"
        self.target.fed_tokens += tokens.shape[0]
        logits, hidden = self._forward(tokens, depths, ancestors)
        return Forward(logits, hidden if self.target.hidden_layers else None)

    def _move(self, start: mx.array, path: mx.array, n: mx.array):
        self.traces += 1
        for c in self.target.state.caches:
            a = c.arrays
            src = mx.clip(start + path, 0, c.capacity - 1)  # [L] the path's slots in tree order
            at = mx.minimum(start, c.capacity - path.shape[0])[None]  # in bounds, as update_and_fetch writes
            a["k"] = mx.slice_update(a["k"], mx.take(a["k"], src, axis=2), at, axes=(2,))
            a["v"] = mx.slice_update(a["v"], mx.take(a["v"], src, axis=2), at, axes=(2,))
            a["pos"] = start + n + 1

    def keep_path(self, start: mx.array, path: mx.array, n: mx.array) -> None:
        """After forward() at position `start` ([] int32): tree slots start + path[d] move to start + d
        for every d of path [L] (tree indices, root first), and the position becomes start + n + 1
        (n [] int32: the accepted nodes; the entries past them are masked and later overwritten)."""
        self._keep(start, path, n)
