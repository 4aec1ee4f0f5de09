"""EAGLE-3: a drafter on fused target features, with a dynamic draft tree verified in one
target forward (arXiv 2503.01840; EAGLE-2 tree policy).

The drafter network, its checkpoint layouts and loader: engines/drafters/eagle3.py.

Tree (EAGLE-2): from the pending token, take the top_k children; for depth-1 more
steps expand the top_k best nodes by cumulative log-probability (each node attends
to the committed context, its ancestors and itself); keep the `total_tokens` best
nodes. The target verifies the tree in one forward with a tree mask and per-node
positions (engines/runtime/tree.py), the longest path matching the target's greedy choices
is accepted, and the target cache is compacted to that path. Against SafeAILab's
(depth D, top_k K, total_token T) the same tree is this engine's (D+1, K, T-1): its
depth counts levels below the root including the first, SafeAILab's the drafter steps
after it, and its total_token counts the root. vLLM's chain of k speculative tokens is
(k, 1, k).

Hybrid (DeltaNet) targets cannot verify a tree (one recurrent state, many branches),
and the tree form of speculative sampling is not implemented: in both cases the
engine drafts and verifies the single best chain (greedy, or sampled with q and
speculative sampling), with exact rollback. Every record says which path ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engines.base import Draft, Engine
from engines.drafters.eagle3 import Eagle3Drafter, default_aux_layers, feature_layers, load_eagle3, read_eagle3_config
from engines.kernels.gemm import small_m_linears
from engines.methods.device import DeviceEngine
from engines.runtime.adaptive import unsure
from engines.runtime.cache import trim_attention
from engines.runtime.hidden import activation_dtype, embed, num_layers
from engines.runtime.prefix import prefix_pass
from engines.runtime.static import Shape, StaticState, StaticTree, capacity_for
from engines.runtime.target import PREFILL_CHUNK
from engines.runtime.tree import accept_tree_on_device

# ---------------------------------------------------------------- the engine

@dataclass
class _Node:
    parent: int  # node index, -1 = root (the pending token)
    score: float  # cumulative log-probability
    depth: int


class Eagle3(Engine):
    name = "eagle3"
    knobs = ("drafter", "verify", "depth", "top_k", "total_tokens")
    drafter_kind = "eagle3"
    adapts_drafts = True  # method.draft_threshold drafts a chain, cut before its first unsure draft

    @classmethod
    def hidden_layers(cls, cfg, model):
        c, _ = read_eagle3_config(Path(cfg.drafter))
        return feature_layers(c.aux_layer_ids or default_aux_layers(num_layers(model)))  # as load_eagle3 picks them

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.drafter = load_eagle3(Path(cfg.drafter), target.model)
        self.depth, self.top_k, self.total = cfg.depth, cfg.top_k, cfg.total_tokens
        # adaptive draft length: a chain cut before its first unsure draft (the tree adapts by its own scores)
        self.threshold = getattr(cfg, "draft_threshold", None)
        self._check_hidden_layers(feature_layers(self.drafter.config.aux_layer_ids))
        for layer in self.drafter.layers:
            layer.self_attn.stable = target.stable_attention
        self.hybrid = target.layout.recurrent > 0  # one recurrent state cannot serve several branches
        self.draft_ids = self.drafter.to_target(mx.arange(self.drafter.config.draft_vocab_size))  # [Vd] target ids
        chain = self.hybrid or self.threshold is not None
        self.block = (self.depth if chain else self.total) + 1  # tokens a full verify feeds

    @property
    def tree_mode(self) -> bool:
        sampling = self.sampler is not None and self.sampler.temperature > 0
        return not (self.hybrid or sampling or self.threshold is not None)

    def prefill(self, prompt):
        self.prompt_len = len(prompt)
        logits, hidden = self.target.prefill(prompt)
        self.features = [hidden]  # [1, n, A*H] target features not yet in the drafter cache
        self.dcache = self.drafter.make_cache()
        self._prepared = None  # prepare()'s commit pass output, for the first draft
        return logits

    def _embed(self, ids: mx.array) -> mx.array:
        # [1, T] ids -> [1, T, H]: the drafter's own embedding where its checkpoint has one, else the target's
        return self.drafter.embed_tokens(ids) if "embed_tokens" in self.drafter else embed(self.target.model, ids)

    def _commit_pass(self, history) -> mx.array:
        """Feed the newly verified positions (feature t, token t+1) into the drafter cache;
        returns the last (pre-norm) output [1, 1, H] (it predicts the token after pending)."""
        feats = self.features[0] if len(self.features) == 1 else mx.concatenate(self.features, axis=1)
        self.features = []
        start = self.dcache[0].offset
        e = self._embed(mx.array([history[start + 1:]], dtype=mx.int32))
        return self.drafter.step(e, self.drafter.fuse(feats), self.dcache, start)[:, -1:]

    def prepare(self, history):
        # The prompt's commit pass (every prompt position into the drafter cache) before the first draft;
        # its part over a restored prefix (bench.context) restored too, so only the rest is fed.
        def over(feats, ids):
            self.features = [feats]
            self._commit_pass(ids)

        feats = self.features[0] if len(self.features) == 1 else mx.concatenate(self.features, axis=1)
        key = ("eagle3", id(self.drafter), self.target.kv, self.target.strategy)
        self.features = [prefix_pass(self.target.prefix, history, feats, key, self.dcache, over)]
        self._prepared = self._commit_pass(history)
        return self._prepared

    def draft(self, history):
        with small_m_linears(self.target.small_m_gemm):  # tree levels are a few rows each (engines/kernels/gemm.py)
            return self._draft(history)

    def _draft(self, history):
        depth = self.depth
        root, self._prepared = (self._prepared if self._prepared is not None else self._commit_pass(history)), None
        self.prof.mark("commit_pass", root)
        committed = self.dcache[0].offset
        draft = (self._tree if self.tree_mode else self._chain)(history, root, depth)
        for c in self.dcache:
            trim_attention(c, c.offset - committed)  # tree/chain entries were drafts
        self.prof.mark("tree_expand", draft.tokens)
        return draft

    def _expand(self, tokens: mx.array, feats: mx.array, ancestors: mx.array, pos: int) -> mx.array:
        """One drafter step for the F frontier nodes, all at position `pos`: tokens [F] (target ids),
        the features that predicted them [1, F, H], ancestors [F, n_prev] marking which of the
        n_prev tree entries already in the drafter cache each node descends from. Their K/V are
        appended after those entries; returns [1, F, H]."""
        F, n_prev = ancestors.shape
        context = self.dcache[0].offset - n_prev
        nodes_part = mx.concatenate([ancestors, mx.eye(F, dtype=mx.bool_)], axis=1)  # ancestors, and itself

        def mask(window):  # [F, C + n_prev + F]: the committed context (within a window), ancestors, self
            seen = mx.ones((F, context), dtype=mx.bool_) if not window else \
                mx.broadcast_to(pos - mx.arange(context) < window, (F, context))
            return mx.concatenate([seen, nodes_part], axis=1)

        return self.drafter.step(self._embed(tokens[None]), feats, self.dcache, pos, tree=mask)

    def _children(self, h: mx.array, parent_scores: mx.array) -> tuple[mx.array, mx.array]:
        """The top_k children of each of F nodes from the drafter's outputs h [F, H]: their target
        ids [F * k] and cumulative scores [F * k] (parent's score + log-probability), row by row."""
        lp = self.drafter.logprobs(h, self.target.model)  # [F, Vd]
        top = mx.argsort(-lp, axis=-1)[:, : self.top_k]  # [F, k], best first
        scores = mx.take_along_axis(lp, top, axis=-1) + parent_scores[:, None]
        return self.drafter.to_target(top).reshape(-1), scores.reshape(-1)

    def _tree(self, history, root, depth) -> Draft:
        """EAGLE-2's tree, selected on the device: each level's frontier (its top_k nodes by score),
        their ancestor masks and features stay device arrays, and the host reads the scores once,
        after the last level, to pick the total_tokens best nodes (_select)."""
        k, pending_pos = self.top_k, len(history) - 1
        tokens, scores = self._children(root[0], mx.zeros((1,)))  # level 1: the root's children [k]
        levels, frontiers = [(tokens, scores)], []  # frontiers[i]: which nodes of level i + 1 were expanded
        frontier, feats = mx.arange(k), mx.repeat(self.drafter.next_feature(root), k, axis=1)  # [k], [1, k, H]
        ancestors = mx.zeros((k, 0), dtype=mx.bool_)
        for d in range(2, depth + 1):
            out = self._expand(mx.take(tokens, frontier), feats, ancestors, pending_pos + d - 2)  # [1, F, H]
            frontiers.append(frontier)
            tokens, scores = self._children(out[0], mx.take(scores, frontier))  # level d: [F * k]
            levels.append((tokens, scores))
            if d < depth:  # the next frontier: this level's k best, in node order; parent = row // k
                frontier = mx.sort(mx.argsort(-scores)[:k])
                parent = frontier // k
                own = mx.eye(ancestors.shape[0], dtype=mx.bool_)[parent]  # the parent's own entry
                ancestors = mx.concatenate([ancestors[parent], own], axis=1)  # [k, n_prev + F]
                feats = mx.take(self.drafter.next_feature(out), parent, axis=1)
        level_scores = [s for _, s in levels]
        mx.eval(level_scores, frontiers)  # the round's one host read of the tree
        nodes = self._nodes([s.tolist() for s in level_scores], [f.tolist() for f in frontiers])
        keep = self._select(nodes)
        index = {old: new for new, old in enumerate(keep)}
        return Draft(mx.take(mx.concatenate([t for t, _ in levels]), mx.array(keep)),
                     parents=[index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep])

    def _nodes(self, level_scores: list[list[float]], frontiers: list[list[int]]) -> list[_Node]:
        """Every drafted node in level order, as concat(levels) numbers them: level d + 1's node
        r * k + j is child j of level d's node frontiers[d - 1][r]."""
        nodes = [_Node(-1, s, 1) for s in level_scores[0]]
        start = 0  # the first node index of the level above level d
        for d, (scores, frontier) in enumerate(zip(level_scores[1:], frontiers), start=2):
            nodes += [_Node(start + frontier[i // self.top_k], s, d) for i, s in enumerate(scores)]
            start += len(level_scores[d - 2])
        return nodes

    def _select(self, nodes: list[_Node]) -> list[int]:
        """The total_tokens best nodes by score (ties: the lower index), closed under ancestors,
        depth first with the best child first (_best_first)."""
        keep = sorted(sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[: self.total])
        return self._best_first(nodes, self._close_under_ancestors(nodes, keep))

    @staticmethod
    def _close_under_ancestors(nodes, keep):
        out = set(keep)
        for i in keep:
            p = nodes[i].parent
            while p >= 0 and p not in out:
                out.add(p)
                p = nodes[p].parent
        return sorted(out)

    @staticmethod
    def _best_first(nodes, keep):
        """`keep` in depth-first order, each node's children best score first: parents still come
        before children, and a path of best children (the likeliest accepted) sits right after the
        root, where commit_tree keeps it with a trim instead of moving cache entries."""
        children: dict[int, list[int]] = {}
        for i in keep:
            children.setdefault(nodes[i].parent, []).append(i)
        order, stack = [], sorted(children.get(-1, []), key=lambda i: (nodes[i].score, -i))
        while stack:
            i = stack.pop()  # the best remaining sibling: stacked last
            order.append(i)
            stack += sorted(children.get(i, []), key=lambda j: (nodes[j].score, -j))
        return order

    def _chain(self, history, root, depth) -> Draft:
        """The single best (or sampled) path, for hybrid targets and temperature > 0: causal
        drafter steps at consecutive positions, every token kept on the device."""
        pending_pos = len(history) - 1
        pos_out = len(history) - self.prompt_len
        sampling = self.sampler is not None and self.sampler.temperature > 0
        tokens, qs, h = [], [], root
        for d in range(1, depth + 1):
            if d > 1:  # the previous draft with the feature that predicted it, at its parent's position
                h = self.drafter.step(self._embed(tokens[-1][None]), self.drafter.next_feature(h), self.dcache,
                                      pending_pos + d - 2)
            logits = self.drafter.logits(h[0, -1], self.target.model)[None]  # [1, Vd]
            pick, q_draft = self.sampler.propose(logits, pos_out + d - 1)
            if self.threshold is not None and unsure(logits, pick, self.threshold):
                break  # a host read per draft step, what an early stop costs
            if sampling:  # q over the target vocabulary, for speculative sampling
                qs.append(mx.zeros((1, self.drafter.config.vocab_size)).at[:, self.draft_ids].add(q_draft))
            tokens.append(self.drafter.to_target(pick))
        if not tokens:
            return Draft()
        return Draft(mx.concatenate(tokens), mx.concatenate(qs) if qs else None)

    def verify(self, pending, draft):
        tokens = mx.concatenate([pending, draft.tokens])
        if draft.parents is not None:
            logits, self.verified_features = self.target.verify_tree(tokens, draft.parents)
        else:
            logits, self.verified_features = self.target_verify(tokens)  # [K+1, V], [1, K+1, A*H]
        return logits

    def rollback(self, n_accepted, draft):
        if draft.parents is not None:
            keep = [0, *(i + 1 for i in draft.accepted_path)]
            self.target.commit_tree(keep)
            self.features.append(self.verified_features[:, mx.array(keep)])
        else:
            self.target.commit(n_accepted + 1)
            self.features.append(self.verified_features[:, : n_accepted + 1])

    def caches(self):
        return [*super().caches(), *getattr(self, "dcache", [])]

    def describe(self):
        c = self.drafter.config
        return {**super().describe(),
                "tree_path": ("chain (hybrid target)" if self.hybrid else "chain (draft_threshold)"
                              if self.threshold is not None else "tree (greedy); chain when sampling"),
                "draft_threshold": self.threshold, "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total, "aux_layer_ids": list(c.aux_layer_ids),
                "draft_vocab_size": c.draft_vocab_size, "layout": c.layout, "drafter_layers": c.num_hidden_layers,
                "layer_type": "qwen3" if c.qk_norm else "llama", "layer_types": list(c.layer_types),
                "sliding_window": c.sliding_window, "norm_before_residual": c.norm_before_residual,
                "norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm, "norm_output": c.norm_output,
                "rope_theta": c.rope_theta, "own_embedding": "embed_tokens" in self.drafter,
                "own_lm_head": "lm_head" in self.drafter}


# ---------------------------------------------------------------- execution=static

def _causal_slots(capacity: int, start: mx.array, n: int, window: int | None) -> mx.array:
    """[n, capacity]: n tokens written at slots start.. (slot = position), each seeing the slots up to
    its own (within `window`): the eager drafter's causal mask, over a static buffer."""
    q = start + mx.arange(n)[:, None]
    k = mx.arange(capacity)[None]
    mask = k <= q
    return mask & (q - k < window) if window else mask


def _tree_slots(capacity: int, base: mx.array, pos: mx.array, nodes: mx.array, window: int | None) -> mx.array:
    """[F, capacity]: F tree nodes at position `pos` whose entries follow the context in slots base..:
    every context slot (< base; within `window` of pos) and, of the B tree slots from base, those that
    nodes [F, B] marks (ancestors, then itself): the eager _expand mask, over a static buffer."""
    k = mx.arange(capacity)[None]
    rel = k - base
    context = k < base
    if window:
        context = context & (pos - k < window)
    own = mx.take(nodes, mx.clip(rel[0], 0, nodes.shape[1] - 1), axis=1)  # [F, C]
    return mx.where((rel >= 0) & (rel < nodes.shape[1]), own, context)


def _top_children(drafter: Eagle3Drafter, target: nn.Module, h: mx.array, parent_scores: mx.array, k: int):
    """Eagle3._children: the top k children of each of F nodes (drafter outputs h [F, H]) as target ids
    [F * k] and cumulative log-probabilities [F * k], row by row."""
    lp = drafter.logprobs(h, target)  # [F, Vd]
    top = mx.argsort(-lp, axis=-1)[:, :k]  # [F, k], best first
    scores = mx.take_along_axis(lp, top, axis=-1) + parent_scores[:, None]
    return drafter.to_target(top).reshape(-1), scores.reshape(-1)


def select_tree(tokens: mx.array, scores: mx.array, parents: mx.array, depths: mx.array, size: int, depth: int):
    """Eagle3._select on the device, with a fixed node count: of N drafted nodes (tokens, cumulative
    scores, parents as node indices with -1 for the root, depths), the `size` best by score (ties: the
    lower index), kept in node order (parents before children). A child never scores above its parent
    and has the higher index, so the kept set is closed under ancestors, as the eager one is.
    Returns the tree: tokens [size], parents [size] (tree indices, 0 = the root), depths [size + 1]
    and the ancestor-or-self mask [size + 1, size + 1] of [root] + nodes."""
    n = scores.shape[0]
    idx = mx.arange(n)
    ahead = (scores[None] > scores[:, None]) | ((scores[None] == scores[:, None]) & (idx[None] < idx[:, None]))
    keep = ahead.sum(axis=1) < size  # [N]: fewer than `size` nodes rank before it
    order = mx.argsort(mx.where(keep, idx, idx + n))[:size]  # the kept nodes, in node order
    tree_index = mx.cumsum(keep.astype(mx.int32))  # a kept node's index in [root] + nodes
    up = mx.take(parents, order)
    tree_parents = mx.where(up < 0, 0, mx.take(tree_index, mx.maximum(up, 0))).astype(mx.int32)  # [size]
    every = mx.concatenate([mx.zeros((1,), dtype=mx.int32), tree_parents])  # the root is its own parent
    eye = mx.eye(size + 1, dtype=mx.bool_)
    ancestors = eye
    for _ in range(depth):  # each pass adds one more generation of ancestors
        ancestors = eye | mx.take(ancestors, every, axis=0)
    tree_depths = mx.concatenate([mx.zeros((1,), dtype=mx.int32), mx.take(depths, order).astype(mx.int32)])
    return mx.take(tokens, order).astype(mx.int32), tree_parents, tree_depths, ancestors


class Eagle3Static(DeviceEngine):
    """EAGLE-3 in a round that stays on the device (engines/methods/device.py), with the eager Eagle3 as its
    reference. The drafter runs on static caches of its own (slot = position), whose position is set
    from the accepted count on the device:

    - The commit pass is the round's first drafter step: it feeds the previous round's verified
      positions, always depth + 1 of them (target features, and the token after each), at the slots
      from the previous pending position, and takes its root (the output that predicts the token
      after pending) at the accepted count n; the entries past n are masked now and overwritten later.
    - Then `depth` drafts: a chain (top_k = 1, or temperature > 0 with speculative sampling), or a
      tree of a fixed node count (greedy, top_k > 1): every level expanded, the best total_tokens
      nodes chosen on the device (select_tree), verified in one target forward with a tree mask
      (engines/runtime/static.py StaticTree), accepted on the device (engines/runtime/tree.py accept_tree_on_device),
      and the accepted path's K/V moved to the slots after the position (StaticTree.keep_path).

    Each drafting phase is one compiled function over the drafter's state (one trace per shape,
    counted in `traces`), the target's forwards compiled by StaticTarget / StaticTree."""

    name = "eagle3"
    knobs = Eagle3.knobs
    drafter_kind = "eagle3"

    @classmethod
    def hidden_layers(cls, cfg, model):
        return Eagle3.hidden_layers(cfg, model)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.drafter = load_eagle3(Path(cfg.drafter), target.model)
        self._check_hidden_layers(feature_layers(self.drafter.config.aux_layer_ids))
        self.depth, self.top_k, self.total = cfg.depth, cfg.top_k, cfg.total_tokens
        c = self.drafter.config
        # Its layers mask their own window (Eagle3Attention gets the mask), so the caches keep no window.
        self.dstate = StaticState([Shape(c.num_key_value_heads, c.head_dim, None)] * c.num_hidden_layers,
                                  activation_dtype(target.model))
        self.tree = StaticTree(target)
        self.size = min(self.total, self.top_k + (self.depth - 1) * self.top_k ** 2)  # nodes a tree keeps
        self.draft_ids = self.drafter.to_target(mx.arange(c.draft_vocab_size))  # [Vd] target ids
        self.traces = 0  # the drafter's compiled traces
        self._phases: dict = {}
        self.block = self._block(True)

    @property
    def tree_mode(self) -> bool:
        return self.top_k > 1 and (self.sampler is None or self.sampler.temperature == 0)

    def _block(self, tree: bool) -> int:
        return (self.size if tree and self.top_k > 1 else self.depth) + 1  # the tokens a verify feeds

    @property
    def reach(self) -> int:
        """The most drafts a round can accept: `depth` (a tree's block - 1 counts its nodes)."""
        return self.depth

    @property
    def tree_size(self) -> int:
        """Nodes a round verifies besides the pending token in tree mode; 0 for a chain (as Round's)."""
        return self.size if self.tree_mode else 0

    def _embed(self, ids: mx.array) -> mx.array:
        return self.drafter.embed_tokens(ids) if "embed_tokens" in self.drafter else embed(self.target.model, ids)

    # -- start: the target's prefill, the drafter's over all prompt positions but the last

    def start(self, prompt, max_new_tokens):
        self.block = self._block(self.tree_mode)
        fwd = self.target.prefill(prompt, max_new_tokens + 2 * self.block)
        self.pending = self.sampler.choose(fwd.logits[None], 0).astype(mx.int32)  # [1]
        self.out_pos = mx.array(1, dtype=mx.int32)
        d, p = self.depth, len(prompt)
        # a commit pass of depth + 1 and a tree's (depth - 1) * top_k entries past the last position
        self.dstate.reset(capacity_for(p + max_new_tokens + 2 * self.block + (d + 1) + (d - 1) * self.top_k))
        for s in range(0, p - 1, PREFILL_CHUNK):  # feature t with token t + 1, eagerly (prompts vary)
            e = min(s + PREFILL_CHUNK, p - 1)
            self._commit(fwd.hidden[:, s:e], mx.array(prompt[s + 1: e + 1], dtype=mx.int32), None)
            mx.eval(self.dstate.arrays)
        self.dstate.set_position(mx.array(p - 1, dtype=mx.int32))
        # The first round's commit pass: the prompt's last position (followed by the first token), padded.
        width = fwd.hidden.shape[-1]
        self.feats = mx.concatenate([fwd.hidden[:, p - 1:], mx.zeros((1, d, width), fwd.hidden.dtype)], axis=1)
        self.fed = mx.concatenate([self.pending, mx.zeros((d,), dtype=mx.int32)])  # [depth + 1]
        self.n = mx.zeros((1,), dtype=mx.int32)
        return self.pending

    def _commit(self, feats: mx.array, fed: mx.array, n: mx.array | None) -> mx.array:
        """Feed verified positions at the drafter's position: feats [1, T, A * Ht] and the token after
        each, fed [T]. With n ([1] accepted count), the root [1, 1, H] (the output at n) and the
        position moved past n; without, the whole output, the position past all T."""
        caches = self.dstate.caches
        start, t = caches[0].offset, fed.shape[0]
        out = self.drafter.step(self._embed(fed[None]), self.drafter.fuse(feats), caches, start + mx.arange(t),
                                tree=lambda w: _causal_slots(self.dstate.capacity, start, t, w))
        if n is None:
            return out
        self.dstate.set_position(start + n[0] + 1)
        return mx.take(out, n, axis=1)

    # -- the drafting phases, each one compiled function of the drafter's state

    def _phase(self, tree: bool):
        key = (tree, self.sampler.temperature, self.sampler.seed)
        if key not in self._phases:  # the sampler is read while tracing: one compiled phase per sampler
            fn = self._draft_tree if tree else self._draft_chain
            self._phases[key] = mx.compile(fn, inputs=self.dstate.arrays, outputs=self.dstate.arrays)
        return self._phases[key]

    def _draft_chain(self, feats, fed, n, out_pos):
        """The commit pass, then `depth` causal drafter steps -> drafts [K] and q [K, V] (or a [0] placeholder)."""
        self.traces += 1  # runs only while mx.compile traces
        sampling = self.sampler.temperature > 0
        root = self._commit(feats, fed, n)
        base = self.dstate.position
        tokens, qs, h = [], [], root
        for d in range(1, self.depth + 1):
            if d > 1:  # the previous draft with the feature that predicted it, at its parent's position
                pos = base + d - 2
                h = self.drafter.step(self._embed(tokens[-1][None]), self.drafter.next_feature(h), self.dstate.caches,
                                      pos[None], tree=lambda w, p=pos: _causal_slots(self.dstate.capacity, p, 1, w))
            logits = self.drafter.logits(h[0, -1], self.target.model)[None]  # [1, Vd]
            pick, q = self.sampler.propose(logits, out_pos + d - 1)
            if sampling:  # q over the target vocabulary, for speculative sampling
                qs.append(mx.zeros((1, self.drafter.config.vocab_size)).at[:, self.draft_ids].add(q))
            tokens.append(self.drafter.to_target(pick).astype(mx.int32))
        self.dstate.set_position(base)  # the next commit pass starts at this round's pending position
        return mx.concatenate(tokens), (mx.concatenate(qs) if qs else mx.zeros((0,)))

    def _draft_tree(self, feats, fed, n, out_pos):
        """The commit pass, then EAGLE-2's tree (Eagle3._tree) with every level expanded and `size`
        nodes kept -> select_tree's tokens, parents, depths and ancestors."""
        self.traces += 1
        k, capacity = self.top_k, self.dstate.capacity
        root = self._commit(feats, fed, n)
        base = self.dstate.position
        tokens, scores = _top_children(self.drafter, self.target.model, root[0], mx.zeros((1,)), k)  # level 1
        all_tokens, all_scores = [tokens], [scores]
        parents, depths = [mx.full((k,), -1, dtype=mx.int32)], [mx.full((k,), 1, dtype=mx.int32)]
        frontier, feats_ = mx.arange(k), mx.repeat(self.drafter.next_feature(root), k, axis=1)  # [k], [1, k, H]
        ancestors, above = mx.zeros((k, 0), dtype=mx.bool_), 0  # above: the first node index of the level above
        for d in range(2, self.depth + 1):
            f = frontier.shape[0]
            nodes = mx.concatenate([ancestors, mx.eye(f, dtype=mx.bool_)], axis=1)  # ancestors, and itself
            pos = base + d - 2
            out = self.drafter.step(self._embed(mx.take(tokens, frontier)[None]), feats_, self.dstate.caches, pos,
                                    tree=lambda w, p=pos, m=nodes: _tree_slots(capacity, base, p, m, w))  # [1, F, H]
            parents.append((above + mx.repeat(frontier, k)).astype(mx.int32))
            above += tokens.shape[0]
            tokens, scores = _top_children(self.drafter, self.target.model, out[0], mx.take(scores, frontier), k)
            all_tokens.append(tokens)
            all_scores.append(scores)
            depths.append(mx.full((f * k,), d, dtype=mx.int32))
            if d < self.depth:  # the next frontier: this level's k best, in node order; parent = row // k
                frontier = mx.sort(mx.argsort(-scores)[:k])
                row = frontier // k
                ancestors = mx.concatenate([ancestors[row], mx.eye(f, dtype=mx.bool_)[row]], axis=1)
                feats_ = mx.take(self.drafter.next_feature(out), row, axis=1)
        self.dstate.set_position(base)
        return select_tree(mx.concatenate(all_tokens), mx.concatenate(all_scores), mx.concatenate(parents),
                           mx.concatenate(depths), self.size, self.depth)

    # -- the round

    def round(self):
        if self.tree_mode:
            return self._tree_round()
        drafts, q = self._phase(False)(self.feats, self.fed, self.n, self.out_pos)
        outcome, fwd = self.verify_and_accept(drafts, q if self.sampler.temperature > 0 else None)
        self.feats, self.fed, self.n = fwd.hidden, outcome[1:], outcome[:1]  # the next commit pass
        return outcome

    def _tree_round(self):
        start = self.target.position  # the pending token's; the tree's root goes there
        tokens, parents, depths, ancestors = self._phase(True)(self.feats, self.fed, self.n, self.out_pos)
        fwd = self.tree.forward(mx.concatenate([self.pending, tokens]), depths, ancestors)  # logits [T, V]
        choices = self.sampler.choose(fwd.logits, self.out_pos)  # greedy: argmax at every tree node
        forced = None if self.force is None else self.force.count(self.depth, self.out_pos)
        outcome, path = accept_tree_on_device(tokens, parents, choices, self.depth, forced)  # [1 + D + 1], [D + 1]
        n = outcome[:1]
        self.tree.keep_path(start, path, n[0])  # the accepted path contiguous after the position
        self.pending = mx.take(outcome[1:], n).astype(mx.int32)
        self.out_pos = self.out_pos + n[0] + 1
        self.feats, self.fed, self.n = mx.take(fwd.hidden, path, axis=1), outcome[1:], n
        return outcome

    def caches(self):
        return [*super().caches(), *self.dstate.caches]

    def state(self):
        return [*super().state(), self.dstate.arrays, self.feats, self.fed, self.n]

    def describe(self):
        c = self.drafter.config
        return {**super().describe(), "tree_path": "tree (greedy, fixed size); chain when sampling or top_k = 1",
                "depth": self.depth, "top_k": self.top_k, "total_tokens": self.total, "tree_size": self.size,
                "aux_layer_ids": list(c.aux_layer_ids), "draft_vocab_size": c.draft_vocab_size,
                "drafter_layers": c.num_hidden_layers, "drafter_traces": self.traces,
                "tree_traces": self.tree.traces, "drafter_capacity": self.dstate.capacity}
