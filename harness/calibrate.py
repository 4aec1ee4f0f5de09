"""Target calibration for a cell's speedup model: the cost of a verify over 1..K+1 tokens at
the prompt's context (calibrate), of a verify plus each recurrent rollback strategy
(compare_rollbacks), and of verify at a 4x longer context (context_scaling).

A verify timing starts from the same cache (target.mark), waits on its result (mx.eval)
before the clock read, then rewinds there: shapes repeat, so the first call per shape, which
pays any compile, is a warm-up and is not timed. context_scaling times profiled generations.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx

from engines.base import Engine
from engines.runtime.cache import ROLLBACK_STRATEGIES
from engines.runtime.sampling import Sampler
from engines.runtime.target import Target
from harness.bounds import nearest_at_or_above, positions_needed, verify_sizes
from harness.generation import run_generation
from harness.heartbeat import HEARTBEAT


def _timed_verify(target: Target, start: tuple, tokens: list[int], n_keep: int | None = None) -> float:
    # ms of one verify (and commit, when n_keep is given) from the cache at `start`, then back there.
    HEARTBEAT.beat(": a verify of %d tokens", len(tokens))
    t0 = time.perf_counter()
    logits = target.verify(tokens).logits
    if n_keep is not None:
        target.commit(n_keep)
    mx.eval(logits, [c.state for c in target.cache])
    dt = time.perf_counter() - t0
    target.rewind(start)
    mx.eval([c.state for c in target.cache])
    return dt * 1e3


def compare_rollbacks(like: Target, ids: list[int], block: int, accept_hist: list[int] | None = None,
                      n: int = 5) -> dict:
    """ms of a verify over `block` tokens plus its rollback, per recurrent rollback strategy,
    averaged over the accepted counts as the cell's own rounds weight them (`accept_hist`:
    rounds per accepted count, from the warm-up; uniform without one), median of n passes
    each: which strategy is fastest for this cell, for a target set up `like` the cell's."""
    counts = list(accept_hist or [])[:block] + [0] * block
    counts = counts[:block] if sum(counts[:block]) else [1] * block  # rounds per keep = accepted + 1
    keeps = verify_sizes(block)  # a bounded set of shapes, whatever the block; a keep counts at the next one
    weights = dict.fromkeys(keeps, 0)
    for keep, rounds in enumerate(counts, 1):
        weights[nearest_at_or_above(keeps, keep)] += rounds
    weights = list(weights.values())
    costs = {}
    for strategy in ROLLBACK_STRATEGIES:
        target = Target(like.model, kv=like.kv, rollback=strategy, kv_group_size=like.kv_group_size,
                        stage_every=like.stage_every, stable_attention=like.stable_attention,
                        small_m_gemm=like.small_m_gemm)
        target.prefill(ids)
        start = target.mark()
        pending = ids[-1]
        for keep in keeps:
            _timed_verify(target, start, [pending] * block, keep)  # warm-up of every shape
        passes = [[_timed_verify(target, start, [pending] * block, keep) for keep in keeps] for _ in range(n)]
        per_keep = [statistics.median(p[i] for p in passes) for i in range(len(keeps))]
        costs[strategy] = sum(w * ms for w, ms in zip(weights, per_keep)) / sum(weights)
    return {"block": block, "verify_and_rollback_ms": costs, "fastest": min(costs, key=costs.get),
            "keeps": keeps, "weights": weights, "weighted_by": "the warm-up's accepted counts" if accept_hist else "uniform"}


def calibrate(target: Target, ids: list[int], block: int, n: int = 7) -> dict:
    """Target cost of a verify over 1..block tokens at this context (ms, medians of n): every
    size up to 16, a geometric grid beyond (harness/bounds.verify_sizes), so its cost stays
    bounded whatever the block; the speedup model interpolates between timed sizes.

    Every call starts from the same cache (the prompt), so its shapes repeat: the
    first call per size, which pays any JIT compile (GPU backends), is not timed.
    Sizes are interleaved within each pass so that drift hits them all alike."""
    target.prefill(ids)
    mx.eval([c.state for c in target.cache])
    start = target.mark()
    pending = ids[-1]
    sizes = verify_sizes(block)
    for t in sizes:
        _timed_verify(target, start, [pending] * t)  # warm-up for this shape
    passes = [[_timed_verify(target, start, [pending] * t) for t in sizes] for _ in range(n)]
    verify = {t: statistics.median(p[i] for p in passes) for i, t in enumerate(sizes)}
    return {"context": len(ids), "block": block, "decode_ms": verify[1], "verify_ms": verify[block],
            "verify_ms_by_tokens": {str(t): ms for t, ms in verify.items()},
            "verify_cost_ratio": verify[block] / verify[1]}


def context_scaling(engine: Engine, ids: list[int], sampler: Sampler, new_tokens: int = 8,
                    context: int | None = None, block: int = 1) -> dict:
    """Verify cost per round at the prompt's context and at a 4x longer one (profiled runs):
    mean verify ms, and the tokens the target was fed per round (work, independent of timing
    noise). Incremental verify (most methods) stays flat; a method that re-reads the whole
    context every round (dflash_c) grows with it. The long context stays inside the model's
    `context` positions; where the prompt leaves no room for a longer one, it is skipped."""
    out = {}
    room = 4 * len(ids) if context is None else context - positions_needed(0, new_tokens, block)
    long = (ids * 4)[: min(max(4 * len(ids), 64), room)]
    for label, prompt in (("short", ids), ("long", long)):
        if label == "long" and len(long) <= len(ids):
            return {**out, "skipped": f"no room for a longer context within the model's {context} positions"}
        run_generation(engine, prompt, new_tokens, sampler)  # warm-up: new shapes compile on GPU backends
        fed = engine.target.fed_tokens
        gen = run_generation(engine, prompt, new_tokens, sampler, profile=True)
        verify = [r.phases["verify"] for r in gen.rounds if r.phases]
        out[label] = {"context": len(prompt), "verify_ms": 1e3 * statistics.mean(verify) if verify else None,
                      "fed_per_round": (engine.target.fed_tokens - fed - len(prompt)) / max(len(gen.rounds), 1)}
    if out["short"]["verify_ms"] and out["long"]["verify_ms"]:
        out["growth"] = out["long"]["verify_ms"] / out["short"]["verify_ms"]
    out["fed_growth"] = out["long"]["fed_per_round"] / out["short"]["fed_per_round"]
    return out
