"""Engines whose rounds stay on the device (`execution=static`): the protocol, and base decoding.

A DeviceEngine keeps its whole decoding state in device arrays (a StaticTarget's caches and
position, the pending token, the output position, its drafter's state) and builds each round
as a lazy graph over that state, with fixed shapes, ending in the round's outcome:

    first = engine.start(prompt, reserve)     # [1] the first token; caches cover the prompt
    outcome = engine.round()                  # [1 + K + 1]: n accepted, then K + 1 tokens of
                                              #   which the first n + 1 are emitted
    (repeat)

round() never reads the host, and its state after the call already assumes the outcome (the
position moved past the accepted tokens, the pending token is the last emitted one), so the
loop (harness/loop.py) queues round n + 1 before it reads round n: one host read per round,
one round late. What a late read shows to lie past the budget or a stop token is discarded by
the loop; the engine's state is then past the generation's end, and the next start() resets it.

Acceptance is engines/runtime/sampling.py's, at an output position held on the device.
"""

from __future__ import annotations

from collections import deque
from typing import ClassVar

import mlx.core as mx

from engines.base import Engine
from engines.errors import Unsupported
from engines.runtime.forced import accept_forced
from engines.runtime.sampling import accept_deterministic, accept_speculative
from engines.runtime.static import StaticKVCache, StaticState, StaticTarget, static_layout


class DeviceEngine(Engine):
    """A method whose rounds stay on the device (module docstring). `block` is K + 1, the tokens a
    round verifies, declared by the engine (the loop and calibration read it).

    `fuse` (set by whoever builds it; dispatch.fuse_rounds) compiles a whole round into one
    function of the engine's state, so Python builds nothing per round but one call. Only a class
    that declares `fusable` is fused: every array of its state must be an attribute of the engine
    or live in a static cache it holds, or the compiled round would keep a stale copy as a constant
    (tests/test_static.py checks a fused generation against a plain one, class by class)."""

    execution: ClassVar[str] = "static"
    fusable: ClassVar[bool] = False

    def __init__(self, target: StaticTarget, cfg):
        super().__init__(target, cfg)
        self.block = 1
        self.pending = None  # [1] int32: the last emitted token, not yet fed to the target
        self.out_pos = None  # [] int32: the output position of the next round's first token
        self.fuse = False
        self._fused: dict = {}  # fuse_key() -> (the compiled round, tokens it feeds each static target)
        self._queued: deque[int] = deque()  # the reach of each round queued and not yet read, oldest first

    @classmethod
    def build(cls, model, cfg, kv: str = "native", **target_kw) -> "DeviceEngine":
        """This engine over a StaticTarget of `model`; Unsupported where the model has no static form."""
        shapes = static_layout(model, kv)
        if isinstance(shapes, str):
            raise Unsupported(f"execution=static: {shapes}")
        return cls(StaticTarget(model, shapes, hidden_layers=cls.hidden_layers(cfg, model), kv=kv), cfg)

    def start(self, prompt: list[int], max_new_tokens: int) -> mx.array:
        """Prefill `prompt` with room for the budget and two rounds past it (the one whose read ends
        the generation, and the one queued behind it); the first token [1] (lazy)."""
        logits = self.target.prefill(prompt, max_new_tokens + 2 * self.block).logits
        self.pending = self.sampler.choose(logits[None], 0).astype(mx.int32)  # [1]
        self.out_pos = mx.array(1, dtype=mx.int32)
        self._queued.clear()
        return self.pending

    @property
    def reach(self) -> int:
        """The most drafts a round can accept: K for a chain, the depth for a tree (the record's `drafted`)."""
        return self.block - 1

    @property
    def tree_size(self) -> int:
        """Nodes a tree round verifies besides the pending token; 0 for a chain."""
        return 0

    def round_reach(self) -> int:
        """The reach of the round round() builds now: `reach`, unless the engine narrows some rounds."""
        return self.reach

    def read(self, values: list[int]) -> int:
        """The loop hands over each outcome it reads (oldest queued first); returns that round's reach.
        An engine may learn from it what to queue next (NgramStatic: whether its drafts matched)."""
        return self._queued.popleft()

    def round(self) -> mx.array:
        raise NotImplementedError

    def fuse_key(self) -> tuple:
        """What a traced round takes as constants: the sampler's temperature and seed, and whatever
        else selects a round's shape (one compiled round per key)."""
        return (self.sampler.temperature, self.sampler.seed)

    def next_round(self) -> mx.array:
        """The loop's call: round(), or the same round compiled whole where `fuse` and `fusable`."""
        self._queued.append(self.round_reach())
        if not (self.fuse and self.fusable):
            return self.round()
        key = self.fuse_key()
        if key not in self._fused:
            self._fused[key] = (mx.compile(self._traced_round), {})
        fused, fed = self._fused[key]
        outcome, state = fused(self._gather())
        self._scatter(state)
        for t in self._static_targets():  # Python that counted tokens ran only while tracing
            t.fed_tokens += fed.get(id(t), 0)
        return outcome

    def _traced_round(self, state: dict):
        self._scatter(state)
        before = {id(t): t.fed_tokens for t in self._static_targets()}
        outcome = self.round()
        fed = self._fused[self.fuse_key()][1]
        for t in self._static_targets():
            fed[id(t)] = t.fed_tokens - before[id(t)]
            t.fed_tokens = before[id(t)]  # next_round adds them, on this call as on every replay
        return outcome, self._gather()

    def _static_targets(self) -> list[StaticTarget]:
        return [v for v in vars(self).values() if isinstance(v, StaticTarget)]

    def _static_arrays(self) -> list[dict]:
        # The arrays dicts of every static cache the engine holds (its targets' and drafters').
        out = []
        for v in vars(self).values():
            if isinstance(v, StaticTarget):
                out += v.state.arrays
            elif isinstance(v, StaticState):
                out += v.arrays
            elif isinstance(v, StaticKVCache):
                out.append(v.arrays)
        return out

    def _gather(self) -> dict:
        return {"attrs": {k: v for k, v in vars(self).items() if isinstance(v, mx.array)},
                "caches": [dict(d) for d in self._static_arrays()]}

    def _scatter(self, state: dict) -> None:
        for k, v in state["attrs"].items():
            setattr(self, k, v)
        for obj, d in zip(self._static_arrays(), state["caches"]):
            obj.update(d)

    def verify_and_accept(self, drafts: mx.array, q: mx.array | None) -> tuple[mx.array, object]:
        """Verify [pending] + drafts [K] in one target forward and accept on the device; returns the
        outcome [1 + K + 1] and the verify's Forward (its hidden states, for drafters that read them).
        The target's position, the pending token and the output position then assume the outcome."""
        start = self.target.position
        fwd = self.target.forward(mx.concatenate([self.pending, drafts]))  # logits [K+1, V]
        if self.force is not None:  # the count chosen on the device, the target's own token after it
            k = drafts.shape[0]
            outcome = accept_forced(drafts, self.sampler.choose(fwd.logits, self.out_pos),
                                    self.force.count(k, self.out_pos))
        elif q is not None and self.sampler.temperature > 0:
            outcome = accept_speculative(drafts, q, fwd.logits, self.sampler, self.out_pos)
        else:
            outcome = accept_deterministic(drafts, self.sampler.choose(fwd.logits, self.out_pos))
        n = outcome[0]
        self.target.set_position(start + n + 1)  # pending and the accepted drafts stay; the rest is masked
        self.pending = mx.take(outcome[1:], n[None]).astype(mx.int32)  # [1] the last emitted token
        self.out_pos = self.out_pos + n + 1
        return outcome, fwd

    def caches(self) -> list:
        return list(self.target.state.caches)

    def state(self) -> list:
        return [self.target.arrays(), *(x for x in (self.pending, self.out_pos) if x is not None)]

    def describe(self) -> dict:
        return {"execution": "static", "capacity": self.target.state.capacity, "traces": self.target.traces,
                "cache_types": ["StaticKVCache"], "fused_rounds": bool(self.fuse and self.fusable),
                "attention": self.target.attention}


class StaticBase(DeviceEngine):
    """Base decoding on static caches: one compiled single-token step per round, queued before
    the previous token is read (harness/loop.py), the way mlx-lm's generate_step pipelines."""

    name = "base"
    drafts = False
    fusable = True

    def round(self) -> mx.array:
        logits, _ = self.target.forward(self.pending)  # [1, V]
        token = self.sampler.choose(logits, self.out_pos).astype(mx.int32)  # [1]
        self.pending, self.out_pos = token, self.out_pos + 1
        return mx.concatenate([mx.zeros((1,), dtype=mx.int32), token])  # [n = 0, token]
