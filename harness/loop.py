"""The decode loop: the one place that drives engines, accepts drafts and reads clocks.

Every method runs through `generate`. Clock reads follow an mx.eval barrier only
where the harness measures: the prefill, each round's end (the acceptance step
already forces the verify result to the host), and -- only when profiling is on --
each phase boundary. With profiling off, phase marks are no-ops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx

from engines.base import Engine, NullProfiler
from engines.sampling import Sampler, accept_deterministic, accept_speculative
from engines.tree import accept_tree_greedy, tree_depths


class Profiler:
    """Per-phase wall time of one round; mark() closes the phase that just ran."""

    enabled = True

    def start(self) -> None:
        self.times: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, phase: str, *arrays) -> None:
        arrays = [a for a in arrays if a is not None]
        if arrays:
            mx.eval(*arrays)
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + (now - self._t)
        self._t = now


@dataclass
class Prefill:
    token: int  # first output token, chosen from the prompt's last logits
    seconds: float


@dataclass
class Round:
    drafted: int  # K tokens proposed (for a tree: its depth, the longest path it could accept)
    accepted: int  # n of them accepted
    emitted: list[int]  # accepted drafts + bonus, cut at the token budget or a stop token
    seconds: float
    phases: dict[str, float] | None  # per-phase seconds when profiling, else None
    tree_size: int = 0  # nodes in the draft tree (0 for chains)


def generate(engine: Engine, prompt: list[int], max_new_tokens: int, sampler: Sampler,
             profile: bool = False, stop_tokens: frozenset[int] = frozenset()) -> Iterator[Prefill | Round]:
    """Yield a Prefill event, then one Round per verify, until max_new_tokens are out."""
    assert max_new_tokens >= 1, "max_new_tokens must be >= 1"
    prof = Profiler() if profile else None
    engine.prof = prof or NullProfiler()
    engine.sampler = sampler  # drafters that sample their drafts draw from its keyed streams
    t0 = time.perf_counter()
    logits = engine.prefill(prompt)
    token = sampler.choose(logits[None], 0).item()
    t1 = time.perf_counter()
    yield Prefill(token, t1 - t0)
    history = [*prompt, token]
    produced = 1
    while produced < max_new_tokens and token not in stop_tokens:
        round_ = _round(engine, history, max_new_tokens - produced, sampler, produced, prof)
        t2 = time.perf_counter()
        round_.seconds, t1 = t2 - t1, t2
        stops = [i for i, t in enumerate(round_.emitted) if t in stop_tokens]
        if stops:
            round_.emitted = round_.emitted[: stops[0] + 1]
        history += round_.emitted
        produced += len(round_.emitted)
        token = history[-1]
        yield round_
    mx.eval(engine.state())  # lazy rollback work of the last round belongs to this run


def _round(engine: Engine, history: list[int], budget: int, sampler: Sampler, pos: int,
           prof: Profiler | None) -> Round:
    # One speculative step: draft, verify [pending] + draft in one forward,
    # accept the longest agreeing prefix plus the target's bonus token, roll back.
    if prof:
        prof.start()
    draft = engine.draft(history, budget - 1)
    reach = len(draft.tokens) if draft.parents is None else max(tree_depths(draft.parents), default=0)
    assert reach <= budget - 1, f"{engine.name} drafted {reach} deep with {budget - 1} tokens left"
    if prof:
        prof.mark("draft", draft.q)
    logits = engine.verify(history[-1], draft)  # [K+1, V]
    if prof:
        prof.mark("verify", logits)
    if draft.parents is not None:
        return _tree_round(engine, draft, logits, sampler, pos, prof, reach)
    if draft.q is not None and sampler.temperature > 0 and draft.tokens:
        n, bonus = accept_speculative(draft, logits, sampler, pos)
    else:
        n, bonus = accept_deterministic(draft, sampler.choose(logits, pos).tolist())
    if prof:
        prof.mark("accept")
    engine.rollback(n, draft)
    if prof:
        prof.mark("rollback", engine.state())
    emitted = [*draft.tokens[:n], bonus]
    return Round(len(draft.tokens), n, emitted, 0.0, prof.times if prof else None)


def _tree_round(engine: Engine, draft, logits, sampler: Sampler, pos: int, prof: Profiler | None,
                depth: int) -> Round:
    # logits [1 + nodes, V]: accept the longest root-to-node path matching the target's greedy choices.
    assert sampler.temperature == 0, "tree drafts are verified greedily; engines draft chains when sampling"
    path, bonus = accept_tree_greedy(draft.tokens, draft.parents, sampler.choose(logits, pos).tolist())
    draft.accepted_path = path
    if prof:
        prof.mark("accept")
    engine.rollback(len(path), draft)
    if prof:
        prof.mark("rollback", engine.state())
    emitted = [*(draft.tokens[i] for i in path), bonus]
    return Round(depth, len(path), emitted, 0.0, prof.times if prof else None, tree_size=len(draft.tokens))
