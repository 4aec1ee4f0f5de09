"""MTP: a multi-token-prediction head as a drafter (the network: engines/drafters/mtp.py).

K > 1 chains the head's one layer: h' and the drafted token feed the next step.

One round, with the MTP cache covering the positions whose target hidden states it
has seen: a first pass over the newly verified positions (one token each) drafts
d1; K-1 chained steps draft d2..dK; verify [pending, d1..dK]; the chained steps'
cache entries are trimmed (they were built on MTP's own hidden, not the target's)
and the accepted positions' target hidden states feed the next first pass.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from engines.base import Draft, Engine
from engines.drafters.mtp import load_mtp
from engines.errors import Unsupported
from engines.kernels.gemm import small_m_linears
from engines.methods.device import DeviceEngine
from engines.runtime.cache import trim_attention
from engines.runtime.hidden import activation_dtype, embed, final_norm, lm_head, num_layers
from engines.runtime.prefix import prefix_pass
from engines.runtime.static import StaticState, attention_shape, capacity_for


class MTP(Engine):
    name = "mtp"
    knobs = ("block_size", "drafter", "verify")
    drafter_kind = "mtp"

    @classmethod
    def hidden_layers(cls, cfg, model):
        return (num_layers(model) - 1,)  # the last layer's output (final-normed here, as MTP reads it)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.head = load_mtp(Path(cfg.drafter), target.model)
        self.k = cfg.block_size - 1
        self._check_hidden_layers(self.hidden_layers(cfg, target.model))

    def prefill(self, prompt):
        self.prompt_len = len(prompt)
        logits, hidden = self.target.prefill(prompt)
        self.hidden = [self._normed(hidden)]  # target states not yet seen by MTP
        self.cache = KVCache()
        self.chained = 0
        self._prepared = None  # prepare()'s first pass over the prompt, for the first draft
        return logits

    def prepare(self, history):
        # MTP's first pass over every prompt position before the first draft; its part over a restored
        # prefix (bench.context) restored too, so only the rest is fed.
        def over(hidden, ids):
            self.hidden = [hidden]
            self._first_pass(ids)

        hidden = self.hidden[0] if len(self.hidden) == 1 else mx.concatenate(self.hidden, axis=1)
        key = ("mtp", id(self.head), self.target.kv, self.target.strategy)
        self.hidden = [prefix_pass(self.target.prefix, history, hidden, key, [self.cache], over)]
        self._prepared = self._first_pass(history)
        return self._prepared

    def _first_pass(self, history) -> mx.array:
        hidden = self.hidden[0] if len(self.hidden) == 1 else mx.concatenate(self.hidden, axis=1)  # [1, n, H]
        self.hidden = []
        start = self.cache.offset  # first position MTP has not seen: pair (h_t, token t+1)
        return self._step(mx.array(history[start + 1:], dtype=mx.int32), hidden)  # [1, n, H]

    def _normed(self, h):
        return final_norm(self.target.model, h)  # the target's last-layer output after its final norm

    def _step(self, tokens: mx.array, hidden: mx.array) -> mx.array:
        x = embed(self.target.model, tokens[None])  # [T] ids -> [1, T, H]
        with self.target.stable():  # its layer is the target's class: one cuDNN plan per cache bucket on CUDA
            return self.head(x, hidden, self.cache)

    def draft(self, history):
        with small_m_linears(self.target.small_m_gemm):  # its first step covers every accepted position
            return self._draft(history)

    def _draft(self, history):
        k = self.k
        out, self._prepared = (self._prepared if self._prepared is not None else self._first_pass(history)), None
        self.prof.mark("mtp_first", out)
        pos = len(history) - self.prompt_len
        tokens, qs = [], []
        h = out[:, -1:]
        for i in range(k):
            if i:
                h = self._step(tokens[-1], h)  # chain: MTP's own state and draft feed the next step
            t, q = self.sampler.propose(lm_head(self.target.model, h[0]), pos + i)  # [1] ids on the device
            tokens.append(t)
            qs.append(q)
        self.chained = k - 1
        self.prof.mark("mtp_chain", tokens[-1])
        return Draft(mx.concatenate(tokens), mx.concatenate(qs) if qs[0] is not None else None)

    def verify(self, pending, draft):
        logits, self.verified = self.target_verify(mx.concatenate([pending, draft.tokens]))  # [K+1, V], [1, K+1, H]
        return logits

    def rollback(self, n_accepted, draft):
        kept = self.verified[:, : n_accepted + 1]  # [1, n+1, H] of the kept positions
        self.target.commit(n_accepted + 1)
        trim_attention(self.cache, self.chained)  # chained entries were built on MTP's own states
        self.chained = 0
        self.hidden.append(self._normed(kept))

    def caches(self):
        return [*super().caches(), *([self.cache] if hasattr(self, "cache") else [])]

    def describe(self):
        return {**super().describe(), "k": self.k}


class MTPStatic(DeviceEngine):
    """MTP in a round that stays on the device (engines/methods/device.py), on dense targets (a Qwen3.5 /
    Qwen3-Next target keeps DeltaNet caches, which have no static form).

    The head's layer keeps its K/V in a StaticKVCache at a device position: the positions whose
    target hidden states it has seen. Each round's first pass always covers the K + 1 positions of
    the previous verify (fixed shape): pairs (target hidden at tp + i, the token emitted at
    tp + i + 1), of which the first `kept` = n + 1 are real. The position then moves by `kept`, the
    first draft is read from the pass's output at row kept - 1 (mx.take with a device index), and
    K - 1 chained steps draft the rest; their entries are dropped again by moving the position back
    (they were built on the head's own states). Both phases are compiled, one trace per shape."""

    name = "mtp"
    knobs = ("block_size", "drafter", "verify")
    drafter_kind = "mtp"
    fusable = True  # its state: engine attributes and a StaticState (DeviceEngine.next_round)

    @classmethod
    def hidden_layers(cls, cfg, model):
        return MTP.hidden_layers(cfg, model)

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.k = cfg.block_size - 1
        if self.k < 1:
            raise Unsupported(f"mtp needs method.block_size >= 2 (one draft or more); got {cfg.block_size}")
        self.block = self.k + 1
        self.head = load_mtp(Path(cfg.drafter), target.model)
        self._check_hidden_layers(self.hidden_layers(cfg, target.model))
        self.mstate = StaticState([attention_shape(self.head.layers[0])], activation_dtype(target.model))
        self.drafter_traces = 0  # compiled traces of the first pass and the chained step: one per shape each
        self._first = mx.compile(self._first_pass, inputs=self.mstate.arrays, outputs=self.mstate.arrays)
        self._chain = mx.compile(self._chain_step, inputs=self.mstate.arrays, outputs=self.mstate.arrays)

    def start(self, prompt, max_new_tokens):
        # DeviceEngine.start, keeping the prompt's hidden states: the head's first pass over the prompt.
        fwd = self.target.prefill(prompt, max_new_tokens + 2 * self.block)
        self.pending = self.sampler.choose(fwd.logits[None], 0).astype(mx.int32)  # [1]
        self.out_pos = mx.array(1, dtype=mx.int32)
        self.mstate.reset(capacity_for(len(prompt) + max_new_tokens + 4 * self.block))
        p, hidden = len(prompt), fwd.hidden  # [1, P, H] raw last-layer outputs
        if p > 1:  # every prompt pair but the last, eagerly (P varies per prompt); its output is not read
            ids = mx.array(prompt[1:], dtype=mx.int32)[None]  # [1, P-1]: the token after each position
            self.head(embed(self.target.model, ids), final_norm(self.target.model, hidden[:, :-1]),
                      self.mstate.caches[0])
        # The last prompt position (paired with the first token) is the first round's one real row.
        pad = self.block - 1
        self.context = mx.concatenate([hidden[:, -1:], mx.zeros((1, pad, hidden.shape[-1]), hidden.dtype)], axis=1)
        self.next_tokens = mx.concatenate([self.pending, mx.zeros((pad,), dtype=mx.int32)])  # [K+1]
        self.kept = mx.array(1, dtype=mx.int32)
        return self.pending

    def _first_pass(self, tokens: mx.array, hidden: mx.array, kept: mx.array):
        # tokens [K+1] (the token after each position), hidden [1, K+1, H] of the last verify (first
        # `kept` real) -> logits [1, V] of the first draft and the head's state there [1, 1, H].
        self.drafter_traces += 1  # runs only while mx.compile traces
        model, start = self.target.model, self.mstate.position
        out = self.head(embed(model, tokens[None]), final_norm(model, hidden), self.mstate.caches[0])  # [1, K+1, H]
        h = mx.take(out, (kept - 1)[None], axis=1)  # [1, 1, H] at the last real row
        self.mstate.set_position(start + kept)  # the rows past it were not real: masked, then overwritten
        return lm_head(model, h[0]), h

    def _chain_step(self, token: mx.array, h: mx.array):
        # token [1], h [1, 1, H]: the head's own last state and draft -> logits [1, V], state [1, 1, H].
        self.drafter_traces += 1
        out = self.head(embed(self.target.model, token[None]), h, self.mstate.caches[0])
        return lm_head(self.target.model, out[0]), out

    def round(self):
        logits, h = self._first(self.next_tokens, self.context, self.kept)
        seen = self.mstate.position  # where the next first pass writes
        tokens, qs = [], []
        for i in range(self.k):
            if i:
                logits, h = self._chain(tokens[-1], h)
            t, q = self.sampler.propose(logits, self.out_pos + i)  # [1] id on the device
            tokens.append(t.astype(mx.int32))
            qs.append(q)
        self.mstate.set_position(seen)  # the chained entries were built on the head's own states
        outcome, fwd = self.verify_and_accept(mx.concatenate(tokens), mx.concatenate(qs) if qs[0] is not None else None)
        # The next first pass: (hidden at tp + i, the token emitted at tp + i + 1), the first n + 1 real.
        self.context, self.next_tokens, self.kept = fwd.hidden, outcome[1:], outcome[0] + 1
        return outcome

    def caches(self):
        return [*super().caches(), *self.mstate.caches]

    def state(self):
        return [*super().state(), self.mstate.arrays, self.context, self.next_tokens, self.kept]

    def describe(self):
        return {**super().describe(), "k": self.k, "drafter_traces": self.drafter_traces}
