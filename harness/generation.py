"""One generation of one engine on one prompt, collected from the decode loop, and the
record fields it gives: per-round columns, time to first token, per-rep timings.

The loop (harness/loop.py) yields events and reads the per-round clocks (an outside arm's
events carry its tokens' arrival times: engines/arms/external.py); run_generation gathers them into
a Generation, ends its decode time at the last token's arrival, keeps how long the generator
went on after it (`tail_s`), checks the generation reached its budget or a stop token, and
reads memory and cache sizes after the clock stops.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import mlx.core as mx

from engines.arms.external import ArmReportError
from engines.base import Engine, Prefill, Round
from engines.runtime.cache import cache_nbytes
from engines.runtime.sampling import Sampler
from harness.heartbeat import HEARTBEAT
from harness.loop import generate


@dataclass
class Generation:
    """One generation of one engine on one prompt."""

    tokens: list[int]
    prefill_s: float
    decode_s: float  # from the first token's arrival to the last token's: the rounds' seconds, end to end
    rounds: list[Round] = field(default_factory=list)
    peak_bytes: int = 0  # peak device memory during the generation (weights included)
    cache_bytes: int = 0  # bytes held by the arm's caches at its end
    first_phases: dict | None = None  # profiled split of the time to first token (prefill, prepare)
    scores: list = field(default_factory=list)  # per output position, the arm's own [V] log-probabilities
    #                                             (external arms that give them, when asked to keep them)
    tail_s: float = 0.0  # from the last token's arrival to the generator's end: the loop's final barrier (the
    #                      last round's lazy rollback), an outside engine's late `done`, a stream left open

    @property
    def decode_tokens(self) -> int:
        # Tokens made in decode_s: not the first (the prefill's), nor any that arrived with it (an
        # outside loop's first round, whose time is in prefill_s): else that arm's rate gains them free.
        return len(self.tokens) - 1 - sum(len(r.emitted) for r in self.rounds if r.with_first)

    @property
    def decode_tps(self) -> float:
        if not self.decode_tokens:
            return 0.0  # every token came with the first (a budget of 1, a stop token at once): no decode rate
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def e2e_tps(self) -> float:
        """Every output token over the whole wait, first token included."""
        total = self.prefill_s + self.decode_s
        return len(self.tokens) / total if total > 0 else float("nan")

    def tally(self) -> dict:
        """What the cell summary pools per rep over prompts (harness/summary.py), as plain numbers."""
        return {"tokens": len(self.tokens), "decode_tokens": self.decode_tokens,
                "prefill_s": self.prefill_s, "decode_s": self.decode_s}

    def acceptance(self) -> dict:
        """tau, histogram and per-position counts over this generation's rounds."""
        k_max = max((r.drafted for r in self.rounds), default=0)
        hist = [0] * (k_max + 1)
        proposed, accepted = [0] * k_max, [0] * k_max
        for r in self.rounds:
            hist[r.accepted] += 1
            for i in range(r.drafted):
                proposed[i] += 1
                accepted[i] += i < r.accepted
        n = len(self.rounds)
        trees = [r.tree_size for r in self.rounds if r.tree_size]
        return {"rounds": n, "tau": sum(len(r.emitted) for r in self.rounds) / n if n else None,
                "tree_size_mean": sum(trees) / len(trees) if trees else None,
                "drafted": sum(r.drafted for r in self.rounds), "accepted": sum(r.accepted for r in self.rounds),
                "accept_hist": hist, "proposed_at": proposed, "accepted_at": accepted,
                # the loop's host reads (None: an outside loop's, unseen) and rounds queued before it read the last
                "host_reads": sum(r.reads for r in self.rounds) if all(r.reads is not None for r in self.rounds) else None,
                "read_ahead": sum(r.ahead for r in self.rounds)}


def run_generation(engine: Engine, ids: list[int], max_new_tokens: int, sampler: Sampler,
                   profile: bool = False, stop_tokens=frozenset(), keep_scores: bool = False) -> Generation:
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gen = Generation([], 0.0, 0.0)
    for ev in generate(engine, ids, max_new_tokens, sampler, profile, stop_tokens):
        if isinstance(ev, Prefill):
            gen.tokens.append(ev.token)
            gen.prefill_s, gen.first_phases = ev.seconds, ev.phases
        else:
            gen.tokens += ev.emitted
            gen.rounds.append(ev)
        if keep_scores and ev.scores is not None:
            gen.scores.append(ev.scores)
        HEARTBEAT.beat(": %d/%d tokens of a %s generation", len(gen.tokens), max_new_tokens, engine.name)
    ended = time.perf_counter()
    # Rounds are timed end to end from the first token, so their sum ends at the last token's
    # arrival: what follows it (a final barrier, a late `done`) is no arm's decoding.
    gen.decode_s = sum(r.seconds for r in gen.rounds)
    gen.tail_s = max(ended - t0 - gen.prefill_s - gen.decode_s, 0.0)
    mx.eval(engine.state())  # untimed: work an arm left in flight must not run inside the next arm's timing
    gen.peak_bytes, gen.cache_bytes = mx.get_peak_memory(), cache_nbytes(engine.caches())
    check_complete(engine, gen.tokens, max_new_tokens, stop_tokens)
    return gen


def check_complete(engine: Engine, tokens: list[int], max_new_tokens: int, stop_tokens: frozenset[int]) -> None:
    """ArmReportError naming the arm when its output ended before the budget without a stop
    token: its tok/s would time a shorter job than the other arm's (an engine that stopped at 5
    of 24 tokens read 61.9x base)."""
    if len(tokens) >= max_new_tokens or (tokens and tokens[-1] in stop_tokens):
        return
    who = engine.who() if engine.external else engine.name
    stops = f"stop ids {sorted(stop_tokens)[:8]}" if stop_tokens else "no stop ids: bench.stop_at_eos=false"
    raise ArmReportError(f"{who} ended after {len(tokens)} of max_new_tokens={max_new_tokens} tokens without a stop "
                         f"token ({stops}). Fix: generate until max_new_tokens, ignoring EOS unless it is "
                         "a stop id (a server: start it so that it ignores EOS, e.g. llama.cpp's --ignore-eos)")


def round_table(gen: Generation) -> dict:
    """The record's per-round columns: column-oriented arrays, compact in JSON, direct to a DataFrame."""
    table = {"drafted": [r.drafted for r in gen.rounds], "accepted": [r.accepted for r in gen.rounds],
             "emitted": [len(r.emitted) for r in gen.rounds], "ms": [round(r.seconds * 1e3, 4) for r in gen.rounds],
             "position": _positions(gen)}
    if any(r.tree_size for r in gen.rounds):
        table["tree_size"] = [r.tree_size for r in gen.rounds]
    phases = sorted({p for r in gen.rounds for p in (r.phases or {})})
    if phases:
        table["phase_ms"] = {p: [round((r.phases or {}).get(p, 0.0) * 1e3, 4) for r in gen.rounds]
                             for p in phases}
    if any(r.host for r in gen.rounds):  # each phase's host time before its barrier (harness/loop.py Profiler)
        table["phase_host_ms"] = {p: [round((r.host or {}).get(p, 0.0) * 1e3, 4) for r in gen.rounds]
                                  for p in phases}
    return table


def _positions(gen: Generation) -> list[int]:
    # The output position (index into gen.tokens) of each round's first token: depth, for acceptance by depth.
    first = len(gen.tokens) - sum(len(r.emitted) for r in gen.rounds)  # the prefill's token(s)
    out = []
    for r in gen.rounds:
        out.append(first)
        first += len(r.emitted)
    return out


OUTLIER_FACTOR = 3.0  # a rep slower than median / this is flagged, never silently averaged


def first_token_ms(gen: Generation) -> dict | None:
    """ms of a profiled run's time to first token, split into the target's prefill and the method's prepare()."""
    return {p: round(1e3 * sec, 4) for p, sec in gen.first_phases.items()} if gen.first_phases else None


def timings(gens: list[Generation]) -> dict:
    """A prompt's record fields from its reps of one arm: per-rep times and rates, outliers, memory."""
    tps = [x.decode_tps for x in gens]
    median = statistics.median(tps)
    return {"prefill_s": [x.prefill_s for x in gens], "decode_s": [x.decode_s for x in gens], "decode_tps": tps,
            "tail_s": [round(x.tail_s, 6) for x in gens],
            "n_tokens_reps": [len(x.tokens) for x in gens], "e2e_tps": [x.e2e_tps for x in gens],
            "outlier_reps": [r for r, t in enumerate(tps) if t < median / OUTLIER_FACTOR],
            # the typical round, untouched by rare slow ones (a recompile, a stall): per-round cost side by side
            "round_ms_median": 1e3 * statistics.median([r.seconds for x in gens for r in x.rounds if not r.with_first]
                                                 or [float("nan")]),
            "peak_memory_bytes": max(x.peak_bytes for x in gens), "cache_bytes": gens[0].cache_bytes}
