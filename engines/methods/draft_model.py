"""Classic speculative decoding: an independent small language model that shares the
target's tokenizer drafts K tokens, one forward each, and the target verifies them in one
forward (Leviathan et al. 2023; mlx-lm's --draft-model, llama.cpp's --model-draft,
Spec-Bench's SpS row).

The draft model runs through its own Target, so its cache gets the same exact rollback as
the target's (a recurrent draft model included; a sliding-window one is refused, as its
single-token steps rotate the window in place): each draft step marks the draft cache,
and rollback rewinds it to the mark of the last accepted draft. At temperature > 0 the
drafts are sampled from the draft model's q and the loop applies speculative sampling, so
the output keeps the target's distribution.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from engines.base import Draft, Engine
from engines.drafters.draft_model import load_draft_model
from engines.errors import Unsupported
from engines.methods.device import DeviceEngine
from engines.runtime.adaptive import KBandit, unsure, weight_bytes
from engines.runtime.static import StaticTarget, static_layout
from engines.runtime.target import Target

DEFAULT_BLOCK_SIZE = 4  # K = 3 drafts per round when method.block_size is null


def _setup(engine, target, cfg):
    """K from method.block_size (DEFAULT_BLOCK_SIZE when null), the block K + 1 and the draft model,
    loaded: what both executions of draft_model set up alike. Returns the draft model."""
    engine.k = (cfg.block_size or DEFAULT_BLOCK_SIZE) - 1
    if engine.k < 1:
        raise Unsupported(f"draft_model needs method.block_size >= 2 (one draft or more); got {cfg.block_size}")
    engine.block = engine.k + 1
    engine.path = Path(cfg.drafter)
    model, engine.config = load_draft_model(engine.path, target)
    return model


class DraftModel(Engine):
    name = "draft_model"
    knobs = ("block_size", "drafter", "verify")
    drafter_kind = "draft_model"
    caps_drafts = True  # each draft is a step of the draft model: none past what the budget can emit
    adapts_drafts = True
    bandit_drafts = True

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.threshold = getattr(cfg, "draft_threshold", None)  # adaptive draft length; None: always K
        model = _setup(self, target, cfg)
        # or K picked each round by a bandit, a draft step priced at the draft model's share of the weights
        self.bandit = (KBandit(self.k, weight_bytes(model) / weight_bytes(target.model))
                       if getattr(cfg, "draft_bandit", False) else None)
        # The draft model's cache stores what the target's does (mlx-lm quantizes both alike).
        self.dm = Target(model, kv=target.kv, rollback=target.strategy, kv_group_size=target.kv_group_size,
                         stage_every=target.stage_every, stable_attention=target.stable_attention,
                         small_m_gemm=target.small_m_gemm)
        if any(isinstance(c, RotatingKVCache) for c in self.dm.cache):
            # Its draft steps are single-token updates, which rotate a full window in place: the
            # cache could not be rewound to an accepted prefix exactly (engines/runtime/cache.py).
            raise Unsupported(f"draft model {self.path} has sliding-window layers; a draft model's chain of "
                              "single-token steps cannot be rewound exactly past its window: use a full-attention "
                              "or hybrid draft model")
        self.cached, self.marks, self.base = 0, [], 0

    def use_prefix(self, prefix) -> None:
        super().use_prefix(prefix)
        self.dm.prefix = prefix  # the draft model's own prefill restores it too

    def prefill(self, prompt):
        self.prompt_len = len(prompt)
        self.dm.reset()
        self.cached = 0  # history tokens in the draft model's cache
        if self.bandit:
            self.bandit.reset()  # each generation learns afresh: reps replay the same Ks
        return self.target.prefill(prompt).logits

    def prepare(self, history):
        # The draft model's own prefill over the prompt (history = prompt + first token).
        self.dm.prefill(history[:-1])
        self.cached = len(history) - 1
        return None

    def draft(self, history):
        pos = len(history) - self.prompt_len  # output position of the first draft
        logits = self.dm.forward_chunked(history[self.cached:]).logits[-1:]  # [1, V]: new tokens, ending at pending
        self.base, self.marks = len(history), [self.dm.mark()]
        tokens, qs = [], []
        k = self.bandit.pick() if self.bandit else self.k
        for i in range(min(k, self.max_drafts or k)):
            if i:
                logits = self.dm.forward(tokens[-1]).logits  # [1] id on the device -> [1, V]
                self.marks.append(self.dm.mark())
            t, q = self.sampler.propose(logits, pos + i)
            if self.threshold is not None and unsure(logits, t, self.threshold):
                break  # adaptive draft length: a host read per draft step, what an early stop costs
            tokens.append(t)
            qs.append(q)
        if not tokens:
            return Draft()
        self.prof.mark("draft_model", tokens[-1])
        return Draft(mx.concatenate(tokens), mx.concatenate(qs) if qs[0] is not None else None)

    def rollback(self, n_accepted, draft):
        if self.bandit and draft.k:
            self.bandit.update(draft.k, n_accepted)
        self.target.commit(n_accepted + 1)
        keep = min(n_accepted, len(self.marks) - 1)  # the last draft was never fed to the draft model
        self.dm.rewind(self.marks[keep])
        self.cached = self.base + keep

    def caches(self):
        return [*super().caches(), *self.dm.cache]

    def describe(self):
        return {**super().describe(), "k": self.k, "draft_threshold": self.threshold,
                "draft_bandit": self.bandit.describe() if self.bandit else None,
                "drafter_model_type": self.config.get("model_type"),
                "drafter_layers": self.config.get("num_hidden_layers"),
                "drafter_cache_types": sorted(set(self.dm.layout.types)), "drafter_fed_tokens": self.dm.fed_tokens}


class DraftModelStatic(DeviceEngine):
    """Draft-model speculation in a round that stays on the device (engines/methods/device.py): the draft
    model runs on static caches of its own (a StaticTarget), K steps a round, always K.

    Its cache holds every position but the last two of the history (dp = tp - 1, tp the target's),
    and each round's first step feeds those two [previous, pending]: the one the draft model has
    not seen, and the one it may have seen as a draft (the same token at the same position, so
    writing it again changes nothing). After the verify both positions follow from the accepted
    count on the device, so no round waits for the host to say how many drafts were kept."""

    name = "draft_model"
    knobs = ("block_size", "drafter", "verify")
    drafter_kind = "draft_model"
    fusable = True

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        model = _setup(self, target, cfg)
        shapes = static_layout(model, target.kv)  # its cache stores what the target's does
        if isinstance(shapes, str):
            raise Unsupported(f"execution=static: the draft model {self.path}: {shapes}")
        self.dm = StaticTarget(model, shapes, kv=target.kv)

    def start(self, prompt, max_new_tokens):
        first = super().start(prompt, max_new_tokens)
        self.dm.prefill(prompt[:-1], 1 + max_new_tokens + 3 * self.block)  # all but the prompt's last token
        self.previous = mx.array(prompt[-1:], dtype=mx.int32)  # [1] the token before pending
        return first

    def round(self):
        start = self.target.position  # tp: the pending token goes there
        logits = self.dm.forward(mx.concatenate([self.previous, self.pending])).logits[-1:]  # [1, V]
        tokens, qs = [], []
        for i in range(self.k):
            if i:
                logits = self.dm.forward(tokens[-1]).logits  # [1, V]
            t, q = self.sampler.propose(logits, self.out_pos + i)
            tokens.append(t.astype(mx.int32))
            qs.append(q)
        drafts = mx.concatenate(tokens)  # [K]
        verified = mx.concatenate([self.pending, drafts])  # [K + 1]
        outcome, _ = self.verify_and_accept(drafts, mx.concatenate(qs) if qs[0] is not None else None)
        n = outcome[0]
        self.previous = mx.take(verified, n[None])  # [1]: the last accepted draft, or the old pending
        self.dm.set_position(start + n)  # dp = tp - 1 once more
        return outcome

    def caches(self):
        return [*super().caches(), *self.dm.state.caches]

    def state(self):
        return [*super().state(), self.dm.arrays(), self.previous]

    def describe(self):
        return {**super().describe(), "k": self.k, "drafter_model_type": self.config.get("model_type"),
                "drafter_layers": self.config.get("num_hidden_layers"), "drafter_traces": self.dm.traces,
                "drafter_fed_tokens": self.dm.fed_tokens}
