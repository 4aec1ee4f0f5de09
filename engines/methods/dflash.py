"""DFlash: a block-diffusion drafter conditioned on target hidden states (arXiv 2602.06036).

One round:
  block [last token, mask x (B-1)] -> drafter forward: every drafter layer attends to
  the projected target context (its own KV cache, grown only by accepted positions)
  and, non-causally, to the whole block -> target lm_head on positions 1..B-1 ->
  B-1 drafts -> verify -> accept prefix + bonus -> rollback -> the accepted
  positions' target hidden states become the drafter's next context.

Two verify strategies share everything else:
- dflash_a (Option A): verify the block incrementally at the end of the output
  (start position = len(output) - 1) and roll back the rejected tail exactly,
  DeltaNet state included (engines/runtime/cache.py).
- dflash_c (Option C): re-prefill the whole sequence from position 0 every round,
  so nothing is ever rolled back, at a cost that grows with the context.

The drafter network, its checkpoint layout and loader: engines/drafters/dflash.py.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from engines.base import Draft, Engine
from engines.drafters.dflash import DFlashAttention, load_drafter, read_drafter_config
from engines.kernels.gemm import small_m_linears
from engines.methods.device import DeviceEngine
from engines.runtime.hidden import activation_dtype, embed, lm_head
from engines.runtime.static import Shape, StaticState, capacity_for


class DFlash(Engine):
    """Shared by Option A and Option C; they differ only in verify() and rollback()."""

    knobs = ("block_size", "drafter")
    drafter_kind = "dflash"

    @classmethod
    def hidden_layers(cls, cfg, model):
        return tuple(read_drafter_config(Path(cfg.drafter))[0].target_layer_ids)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.threshold = getattr(cfg, "draft_threshold", None)  # adaptive draft length (dflash_a); None: always K
        self.drafter = load_drafter(cfg.drafter, target.model)
        self.block = cfg.block_size or self.drafter.config.block_size
        self.draft_block = self.block  # positions a drafter pass fills ([pending, mask x K]); a tree verifies more
        self.mask_id = self.drafter.config.mask_token_id
        self._check_hidden_layers(self.drafter.config.target_layer_ids)
        for layer in self.drafter.layers:
            layer.self_attn.stable = target.stable_attention

    def prefill(self, prompt):
        self.prompt_len = len(prompt)
        logits, hidden = self.target.prefill(prompt)
        self.context = [hidden]  # [1, n, n*H] target hidden states not yet in the drafter's cache
        self.dcache = self.drafter.make_cache()
        return logits

    def prepare(self, history):
        # The prompt's context (projection and every drafter layer's K/V) before the first draft.
        with small_m_linears(self.target.small_m_gemm):
            self.drafter.feed_context(self.drafter.project_context(self._pending_context()), self.dcache)

    def _pending_context(self) -> mx.array:
        hidden = self.context[0] if len(self.context) == 1 else mx.concatenate(self.context, axis=1)
        self.context = []
        return hidden  # [1, S, n*H]

    def draft(self, history):
        logits = self.block_logits(history)  # [K, V]
        tokens, q = self.sampler.propose(logits, len(history) - self.prompt_len)  # [K] on the device
        self.prof.mark("drafter_argmax", tokens)
        if self.threshold is not None:  # adaptive draft length: the block cut before its first unsure draft
            m = _sure_prefix(logits, tokens, self.threshold)
            tokens, q = tokens[:m], (q[:m] if q is not None else None)
        return Draft(tokens, q)

    def block_logits(self, history) -> mx.array:
        """The drafter's forward over [pending, mask x K] after the pending context: logits [K, V] of the
        block's K positions, each from the same pass (a position's distribution does not depend on the
        tokens drafted before it)."""
        k = self.draft_block - 1
        ids = mx.array([[history[-1]] + [self.mask_id] * k], dtype=mx.int32)
        x = embed(self.target.model, ids)  # [1, K+1, H], the target's own embedding scale included
        if self.drafter.config.input_embedding_scale != 1.0:
            x = x * self.drafter.config.input_embedding_scale
        self.prof.mark("embed", x)
        with small_m_linears(self.target.small_m_gemm):  # the drafter's matmuls are over a few rows too
            if self.context:
                ctx = self.drafter.project_context(self._pending_context())  # [1, S, H]
            else:  # right after prepare(): the prompt's context is in the cache already
                ctx = mx.zeros((1, 0, x.shape[-1]), dtype=x.dtype)
            self.prof.mark("extract", ctx)
            h = self.drafter(x, ctx, self.dcache)[:, 1:]  # [1, K, H]
            self.prof.mark("drafter_fwd", h)
            return self.drafter.logits(lm_head(self.target.model, h, softcap=False))[0]  # [K, V]

    def caches(self):
        return [*super().caches(), *getattr(self, "dcache", [])]

    def verify(self, pending, draft):
        logits, self.verified = self.target_verify(mx.concatenate([pending, draft.tokens]))  # [K+1, V], [1, K+1, n*H]
        return logits

    def rollback(self, n_accepted, draft):
        self.context.append(self.verified[:, : n_accepted + 1])  # [1, n+1, n*H] of the kept positions
        self._commit(n_accepted)

    def describe(self):
        c = self.drafter.config
        return {**super().describe(), "drafter_layers": c.num_hidden_layers, "target_layer_ids": list(c.target_layer_ids),
                "drafter_block_size": c.block_size, "block_size": self.block, "layer_types": list(c.layer_types),
                "sliding_window": c.sliding_window, "block_causal": [c.causal(i) for i in range(c.num_hidden_layers)],
                "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "draft_threshold": self.threshold}


def _sure_prefix(logits: mx.array, tokens: mx.array, threshold: float) -> int:
    """How many of the block's drafts (tokens [K], from logits [K, V]) come before the first the drafter gives
    less than `threshold` probability: one host read a round, what the early stop costs."""
    p = mx.softmax(logits.astype(mx.float32), axis=-1)[mx.arange(tokens.shape[0]), tokens]  # [K]
    unsure = (p < threshold).tolist()
    return unsure.index(True) if True in unsure else len(unsure)


class DFlashA(DFlash):
    """Option A: incremental verify at the end of the output, exact rollback."""

    name = "dflash_a"
    knobs = ("block_size", "drafter", "verify")
    adapts_drafts = True

    def _commit(self, n_accepted):
        self.target.commit(n_accepted + 1)


class DFlashC(DFlash):
    """Option C: every round re-prefills prompt + output + block from position 0."""

    name = "dflash_c"
    incremental_verify = False  # the speedup model must take its verify cost from the profile

    def draft(self, history):
        self.sequence = history  # prompt + output, pending last
        return super().draft(history)

    def verify(self, pending, draft):
        self.target.prefill(self.sequence[:-1], reuse=False)  # the whole prefix, from position 0: Option C's cost
        logits, self.verified = self.target.forward(mx.concatenate([pending, draft.tokens]))  # [K+1, V], [1, K+1, n*H]
        return logits

    def _commit(self, n_accepted):
        pass  # the next round rebuilds the cache from position 0


# ---------------------------------------------------------------- execution=static

def _static_block_mask(start: mx.array, kept: mx.array, S: int, L: int, C: int, window: int | None,
                       causal: bool) -> mx.array:
    """[L, C] which buffer slots each block row sees when [ctx (S rows, the first `kept` real); block (L)]
    was written at `start`: the context before the block (slots < start + kept, within `window`), and
    the block's own slots start + S.. (rows 0..i if causal); the rejected context rows between are not."""
    ctx_end = start + kept  # the block's first position: the context the drafter has seen ends there
    slot, row = mx.arange(C)[None], mx.arange(L)[:, None]  # [1, C], [L, 1]
    visible = slot < ctx_end
    if window:
        visible = visible & (ctx_end + row - slot < window)
    first = start + S  # the block's first slot
    block = (slot >= first) & (slot < first + L)
    if causal:
        block = block & (slot - first <= row)
    return visible | block


def _static_block_attention(attn: DFlashAttention, x: mx.array, ctx: mx.array, rope, cache, start: mx.array,
                            kept: mx.array, masks: dict) -> mx.array:
    """DFlashAttention._decode on a StaticKVCache at device position `start`, in fixed shapes: the K/V
    of all S context rows (the first `kept` real) and the L block rows are one write; the block's rope
    and mask place it right after the kept rows (position start + kept), as the eager cache would."""
    S, L = ctx.shape[1], x.shape[1]
    rows = mx.concatenate([ctx, x], axis=1)  # [1, S + L, H]
    k = attn._heads(attn.k_proj(rows), attn.n_kv, attn.k_norm)  # [1, Hkv, S + L, D]
    k = mx.concatenate([rope(k[:, :, :S], offset=start), rope(k[:, :, S:], offset=start + kept)], axis=2)
    keys, values = cache.update_and_fetch(k, attn._heads(attn.v_proj(rows), attn.n_kv))  # [1, Hkv, C, D]
    q = rope(attn._heads(attn.q_proj(x), attn.n_heads, attn.q_norm), offset=start + kept)  # [1, Hq, L, D]
    key = (attn.window, attn.causal)
    if key not in masks:  # layers alike share one mask per forward
        masks[key] = _static_block_mask(start, kept, S, L, keys.shape[2], attn.window, attn.causal)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=masks[key])
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, L, -1))


class DFlashAStatic(DeviceEngine):
    """DFlash Option A in a round that stays on the device (engines/methods/device.py).

    The drafter's context K/V live in StaticKVCaches of its own at a device position `dpos`: the
    number of target positions whose hidden states it has seen, which is the target position of the
    pending token. Each round feeds the previous verify's hidden states of all K + 1 verified
    positions (fixed shape; the first `kept` = n + 1 of them were accepted) together with the block
    [pending, mask x K] in one compiled drafter forward: their K/V are one write at dpos, the block's
    rope and mask place it at dpos + kept (the rejected rows between are masked, and overwritten by
    the next round's write), and the position then moves to dpos + kept. The block is always K + 1."""

    name = "dflash_a"
    knobs = ("block_size", "drafter", "verify")
    drafter_kind = "dflash"
    fusable = True  # its state: engine attributes and a StaticState (DeviceEngine.next_round)

    @classmethod
    def hidden_layers(cls, cfg, model):
        return tuple(read_drafter_config(Path(cfg.drafter))[0].target_layer_ids)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.drafter = load_drafter(cfg.drafter, target.model)
        c = self.drafter.config
        self.block = cfg.block_size or c.block_size
        self.k = self.block - 1
        self._check_hidden_layers(c.target_layer_ids)
        self.masks = mx.full((self.k,), c.mask_token_id, dtype=mx.int32)  # [K]
        self.dstate = StaticState([Shape(layer.self_attn.n_kv, c.head_dim, layer.self_attn.window)
                                   for layer in self.drafter.layers], activation_dtype(target.model))
        self.drafter_traces = 0  # compiled traces of the drafter forward: one per capacity, never one per step
        self._draft = mx.compile(self._draft_logits, inputs=self.dstate.arrays, outputs=self.dstate.arrays)

    def start(self, prompt, max_new_tokens):
        # DeviceEngine.start, keeping the prompt's hidden states: the drafter's first context.
        fwd = self.target.prefill(prompt, max_new_tokens + 2 * self.block)
        self.pending = self.sampler.choose(fwd.logits[None], 0).astype(mx.int32)  # [1]
        self.out_pos = mx.array(1, dtype=mx.int32)
        # dpos <= the target's position, and a round writes 2 (K + 1) rows past it
        self.dstate.reset(capacity_for(len(prompt) + max_new_tokens + 4 * self.block))
        ctx = self.drafter.project_context(fwd.hidden)  # [1, P, H]
        for layer, cache in zip(self.drafter.layers, self.dstate.caches):
            layer.self_attn.write_context(ctx, self.drafter._rope, cache)  # eager: P varies per prompt
        self.context = mx.zeros((1, self.block, fwd.hidden.shape[-1]), dtype=fwd.hidden.dtype)  # [1, K+1, n*H]
        self.kept = mx.array(0, dtype=mx.int32)  # none of those rows is real yet
        return self.pending

    def _draft_logits(self, block: mx.array, hidden: mx.array, kept: mx.array) -> mx.array:
        # block [K+1] ids, hidden [1, K+1, n*H] of the last verify (first `kept` real) -> logits [K, V].
        self.drafter_traces += 1  # runs only while mx.compile traces
        d, c = self.drafter, self.drafter.config
        x = embed(self.target.model, block[None])  # [1, K+1, H]
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        ctx = d.project_context(hidden)  # [1, K+1, H]
        start, masks = self.dstate.position, {}
        h = x
        for layer, cache in zip(d.layers, self.dstate.caches):
            h = h + _static_block_attention(layer.self_attn, layer.input_layernorm(h), ctx, d._rope, cache, start,
                                            kept, masks)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        self.dstate.set_position(start + kept)  # the accepted context stays; the block was written to be attended
        h = d.norm(h)[:, 1:]  # [1, K, H]
        return d.logits(lm_head(self.target.model, h, softcap=False))[0]

    def round(self):
        logits = self._draft(mx.concatenate([self.pending, self.masks]), self.context, self.kept)  # [K, V]
        drafts, q = self.sampler.propose(logits, self.out_pos)  # [K], [K, V] or None
        outcome, fwd = self.verify_and_accept(drafts.astype(mx.int32), q)
        self.context, self.kept = fwd.hidden, outcome[0] + 1  # read by the next round's drafter forward
        return outcome

    def caches(self):
        return [*super().caches(), *self.dstate.caches]

    def state(self):
        return [*super().state(), self.dstate.arrays, self.context, self.kept]

    def describe(self):
        c = self.drafter.config
        return {**super().describe(), "k": self.k, "block_size": self.block, "drafter_layers": c.num_hidden_layers,
                "target_layer_ids": list(c.target_layer_ids), "drafter_traces": self.drafter_traces}
