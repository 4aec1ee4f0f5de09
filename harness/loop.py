"""The decode loop: the one place that drives engines, accepts drafts and reads clocks.

Every method runs through `generate`. A drafting round builds draft, verify and
acceptance as one lazy graph and reads the host once, for its outcome (accepted count
and emitted tokens); rollback then queues its work on top. Engines that never draft
(base, control) run pipelined as mlx-lm's generate_step does: the next step is queued
before the current token is read, so the device never waits for Python.

Engines run on the stream mlx-lm generates on (mlx_lm.generate.generation_stream), as both
reference arms do, so every arm of a cell queues its work the same way.

Clock reads: the first token's (the prefill's end, then the method's prepare() over the
prompt, so a drafter's prompt-side work counts as time to first token), each round's end
(its outcome read),
and -- only when profiling is on -- each phase boundary, behind an mx.eval barrier.
With profiling off, phase marks are no-ops and nothing else synchronises.
"""

from __future__ import annotations

import time
from typing import Iterator

import mlx.core as mx
from mlx_lm.generate import generation_stream

from engines.base import Draft, Engine, NullProfiler, Prefill, Round
from engines.runtime.forced import accept_forced
from engines.runtime.sampling import Sampler, accept_deterministic, accept_speculative
from engines.runtime.tree import accept_tree_greedy, tree_depths

STREAM = generation_stream


class Profiler:
    """Per-phase wall time of one round; mark() closes the phase that just ran. `host` holds the
    part of each phase spent before its barrier: building the phase's lazy graph (and any host
    read inside it, waits included). On a GPU the rest is the device's work and MLX's own
    evaluation; a phase with no read inside it whose time is nearly all host is bound by the
    Python that builds it."""

    enabled = True

    def start(self) -> None:
        self.times: dict[str, float] = {}
        self.host: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, phase: str, *arrays) -> None:
        built = time.perf_counter()
        arrays = [a for a in arrays if a is not None]
        if arrays:
            mx.eval(*arrays)
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + (now - self._t)
        self.host[phase] = self.host.get(phase, 0.0) + (built - self._t)
        self._t = now


def generate(engine: Engine, prompt: list[int], max_new_tokens: int, sampler: Sampler,
             profile: bool = False, stop_tokens: frozenset[int] = frozenset()) -> Iterator[Prefill | Round]:
    """Yield a Prefill event, then one Round per verify, until max_new_tokens are out."""
    assert max_new_tokens >= 1, "max_new_tokens must be >= 1"
    prof = Profiler() if profile else None
    engine.prof = prof or NullProfiler()
    engine.sampler = sampler  # drafters that sample their drafts draw from its keyed streams
    if engine.external:  # a reference implementation runs its own loop
        yield from engine.generate(prompt, max_new_tokens, sampler, stop_tokens)
        return
    if engine.execution == "static":  # rounds that stay on the device, read one round late
        yield from _on_device(engine, prompt, max_new_tokens, stop_tokens)
        return
    t0 = time.perf_counter()
    with mx.stream(STREAM):
        first = sampler.choose(engine.prefill(prompt)[None], 0)  # [1]
    if not engine.drafts and not profile:
        yield from _pipelined(engine, first, t0, max_new_tokens, sampler, stop_tokens)
        return
    token = first.item()
    history = [*prompt, token]
    t_prefill = time.perf_counter()
    with mx.stream(STREAM):
        prepared = engine.prepare(history)
    mx.eval(engine.state(), prepared)  # the prompt-side work belongs to the first token, not to round 1
    t1 = time.perf_counter()
    yield Prefill(token, t1 - t0, {"prefill": t_prefill - t0, "prepare": t1 - t_prefill} if profile else None)
    produced = 1
    while produced < max_new_tokens and token not in stop_tokens:
        with mx.stream(STREAM):
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


def _pipelined(engine: Engine, token: mx.array, t0: float, max_new_tokens: int, sampler: Sampler,
               stop_tokens: frozenset[int]) -> Iterator[Prefill | Round]:
    # One decode step per round, each queued before the previous token is read.
    empty = Draft()

    def step(tok: mx.array, pos: int) -> mx.array:
        with mx.stream(STREAM):
            nxt = sampler.choose(engine.verify(tok, empty), pos)  # [1]
            engine.rollback(0, empty)
        mx.async_eval(nxt)
        return nxt

    mx.async_eval(token)
    nxt = step(token, 1) if max_new_tokens > 1 else None
    value = token.item()
    t1 = time.perf_counter()
    yield Prefill(value, t1 - t0)
    for produced in range(1, max_new_tokens):
        if value in stop_tokens:
            break
        token, nxt = nxt, (step(nxt, produced + 1) if produced + 1 < max_new_tokens else None)
        value = token.item()
        t2 = time.perf_counter()
        yield Round(0, 0, [value], t2 - t1, None, reads=1, ahead=True)
        t1 = t2
    mx.eval(engine.state())


def _on_device(engine, prompt: list[int], max_new_tokens: int, stop_tokens: frozenset[int]) -> Iterator[Prefill | Round]:
    # engines/methods/device.py: each round is queued before the previous one is read, so the device never
    # waits for Python; a round's one host read is its outcome [n, K + 1 tokens]. Rounds queued past
    # the budget or a stop token are read never: their tokens are discarded with the engine's state.
    t0 = time.perf_counter()
    with mx.stream(STREAM):
        first = engine.start(prompt, max_new_tokens)
        ahead = engine.next_round() if max_new_tokens > 1 else None
    mx.async_eval(first, *([ahead] if ahead is not None else []))
    token = first.item()
    t1 = time.perf_counter()
    yield Prefill(token, t1 - t0)
    produced = 1
    while produced < max_new_tokens and token not in stop_tokens:
        outcome = ahead
        with mx.stream(STREAM):
            ahead = engine.next_round()
        mx.async_eval(ahead)
        values = outcome.tolist()  # the round's one host read, made after the next round is queued
        reach = engine.read(values)
        n = values[0]
        emitted = values[1: n + 2][: max_new_tokens - produced]
        stops = [i for i, t in enumerate(emitted) if t in stop_tokens]
        if stops:
            emitted = emitted[: stops[0] + 1]
        t2 = time.perf_counter()
        yield Round(reach, n, emitted, t2 - t1, None, tree_size=engine.tree_size, reads=1, ahead=True)
        t1 = t2
        produced += len(emitted)
        token = emitted[-1]


def _round(engine: Engine, history: list[int], budget: int, sampler: Sampler, pos: int,
           prof: Profiler | None) -> Round:
    # One speculative step: draft, verify [pending] + draft in one forward, accept the
    # longest agreeing prefix plus the target's bonus token, read the outcome, roll back.
    if prof:
        prof.start()
    if engine.caps_drafts:  # drafts past the budget less the bonus token can never be emitted
        engine.max_drafts = max(budget - 1, 1)
    draft = engine.draft(history)  # else the full K even near the end: the budget cuts what is emitted
    reach = draft.k if draft.parents is None else max(tree_depths(draft.parents), default=0)
    if prof:
        prof.mark("draft", draft.tokens, draft.q)
    elif draft.k:
        mx.async_eval(draft.tokens)  # the drafter runs while the verify graph is built
    logits = engine.verify(mx.array([history[-1]], dtype=mx.int32), draft)  # [K+1, V]
    if prof:
        prof.mark("verify", logits)
    if draft.parents is not None:
        return _tree_round(engine, draft, logits, sampler, pos, prof, reach, budget)
    if engine.force is not None:  # the count chosen, the target's own token after it
        outcome = accept_forced(draft.tokens, sampler.choose(logits, pos), engine.force.count(draft.k, pos))
    elif draft.q is not None and sampler.temperature > 0 and draft.k:
        outcome = accept_speculative(draft.tokens, draft.q, logits, sampler, pos)
    else:
        outcome = accept_deterministic(draft.tokens, sampler.choose(logits, pos))
    values = outcome.tolist()  # [n, emitted...]: the round's one host read
    n = values[0]
    if prof:
        prof.mark("accept")
    engine.rollback(n, draft)
    if prof:
        prof.mark("rollback", engine.state())
    emitted = values[1: min(n + 2, budget + 1)]
    return Round(draft.k, n, emitted, 0.0, prof.times if prof else None, host=prof.host if prof else None, reads=1)


def _tree_round(engine: Engine, draft: Draft, logits, sampler: Sampler, pos: int, prof: Profiler | None,
                depth: int, budget: int) -> Round:
    # logits [1 + nodes, V]: accept the longest root-to-node path matching the target's greedy choices.
    assert sampler.temperature == 0, "tree drafts are verified greedily; engines draft chains when sampling"
    both = mx.concatenate([draft.tokens, sampler.choose(logits, pos).astype(mx.int32)]).tolist()  # one read
    nodes, choices = both[: draft.k], both[draft.k:]
    if engine.force is not None:  # a path of the chosen depth, the target's own token after it
        path = engine.force.path(draft.parents, pos)
        bonus = choices[path[-1] + 1 if path else 0]
    else:
        path, bonus = accept_tree_greedy(nodes, draft.parents, choices)
    draft.accepted_path = path
    if prof:
        prof.mark("accept")
    engine.rollback(len(path), draft)
    if prof:
        prof.mark("rollback", engine.state())
    emitted = [*(nodes[i] for i in path), bonus][:budget]
    return Round(depth, len(path), emitted, 0.0, prof.times if prof else None, tree_size=draft.k,
                 host=prof.host if prof else None, reads=1)
