"""Measuring one cell: the method arm and the base arm, interleaved prompt by prompt.

Per prompt: `warmup` untimed generations of each arm (first prompt only: first calls
compile), then `reps` timed generations alternating method, base, method, base...,
so every speed ratio comes from runs side by side in one process. The base arm's
tokens are the reference for divergence. With bench.profile, one more method
generation runs with per-phase barriers; its timings feed the phase profile only,
never tok/s.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from engines.base import Engine
from engines.sampling import Sampler
from harness.loop import Prefill, Round, generate
from harness.prompts import Prompt, encode_turn


@dataclass
class Generation:
    """One generation of one engine on one prompt."""

    tokens: list[int]
    prefill_s: float
    decode_s: float  # from the first token to the last, including the last round's barrier
    rounds: list[Round] = field(default_factory=list)

    @property
    def decode_tokens(self) -> int:
        return len(self.tokens) - 1  # the first token comes from the prefill

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
        return {"rounds": n, "tau": self.decode_tokens / n if n else None,
                "drafted": sum(r.drafted for r in self.rounds), "accepted": sum(r.accepted for r in self.rounds),
                "accept_hist": hist, "proposed_at": proposed, "accepted_at": accepted}


def run_generation(engine: Engine, ids: list[int], max_new_tokens: int, sampler: Sampler,
                   profile: bool = False, stop_tokens=frozenset()) -> Generation:
    t0 = time.perf_counter()
    gen = Generation([], 0.0, 0.0)
    for ev in generate(engine, ids, max_new_tokens, sampler, profile, stop_tokens):
        if isinstance(ev, Prefill):
            gen.tokens.append(ev.token)
            gen.prefill_s = ev.seconds
        else:
            gen.tokens += ev.emitted
            gen.rounds.append(ev)
    gen.decode_s = time.perf_counter() - t0 - gen.prefill_s
    return gen


def divergence(tokens: list[int], reference: list[int]) -> dict:
    """First index where `tokens` leaves `reference` (None if it never does)."""
    n = min(len(tokens), len(reference))
    first = next((i for i in range(n) if tokens[i] != reference[i]), None)
    if first is None and len(tokens) != len(reference):
        first = n
    matched = n if first is None else first
    return {"first_divergence": first, "matched_prefix": matched,
            "matched_fraction": matched / max(len(reference), 1)}


def _tps(gens: list[Generation]) -> float:
    secs = sum(g.decode_s for g in gens)
    return sum(g.decode_tokens for g in gens) / secs if secs > 0 else float("nan")


def _round_table(gen: Generation) -> dict:
    # Column-oriented per-round arrays: compact in JSON, direct to a DataFrame.
    table = {"drafted": [r.drafted for r in gen.rounds], "accepted": [r.accepted for r in gen.rounds],
             "ms": [round(r.seconds * 1e3, 4) for r in gen.rounds]}
    phases = sorted({p for r in gen.rounds for p in (r.phases or {})})
    if phases:
        table["phase_ms"] = {p: [round((r.phases or {}).get(p, 0.0) * 1e3, 4) for r in gen.rounds]
                             for p in phases}
    return table


@dataclass
class Arms:
    method: Engine
    base: Engine | None  # None when the method is base itself


def measure_cell(arms: Arms, tokenizer, prompts: list[Prompt], bench, progress=None) -> dict:
    """Run every prompt (and turn) of the cell; returns the record's per-prompt list and summary."""
    sampler = Sampler(bench.temperature, bench.seed)
    stop = frozenset(tokenizer.eos_token_ids) if bench.stop_at_eos else frozenset()
    items, reps_m, reps_b = [], [[] for _ in range(bench.reps)], [[] for _ in range(bench.reps)]
    units = [(p, t) for p in prompts for t in range(len(p.turns))]
    answers: dict[str, list[str]] = {}
    for u, (prompt, turn) in enumerate(units):
        ids = encode_turn(tokenizer, prompt, turn, answers.get(prompt.id, []), bench.chat_template)
        run = lambda eng, profile=False: run_generation(eng, ids, bench.max_new_tokens, sampler, profile, stop)
        if u == 0:
            for _ in range(bench.warmup):
                run(arms.method)
                if arms.base:
                    run(arms.base)
        gm, gb = [], []
        for r in range(bench.reps):
            gm.append(run(arms.method))
            reps_m[r].append(gm[-1])
            if arms.base:
                gb.append(run(arms.base))
                reps_b[r].append(gb[-1])
        ref = gb[0] if arms.base else gm[0]
        answers.setdefault(prompt.id, []).append(tokenizer.decode(ref.tokens))
        prof = run(arms.method, profile=True) if bench.profile else None
        items.append(_prompt_item(prompt, turn, ids, gm, gb, prof))
        if progress:
            progress(u + 1, len(units))
    return {"prompts": items, "summary": _summary(items, reps_m, reps_b if arms.base else None)}


def _prompt_item(prompt: Prompt, turn: int, ids, gm: list[Generation], gb: list[Generation],
                 prof: Generation | None) -> dict:
    g = gm[0]
    ref = gb[0].tokens if gb else g.tokens
    item = {"id": prompt.id, "category": prompt.category, "turn": turn, "prompt_tokens": len(ids),
            "tokens": g.tokens, "n_tokens": len(g.tokens),
            "deterministic": all(x.tokens == g.tokens for x in gm[1:] + ([prof] if prof else [])),
            "prefill_s": [x.prefill_s for x in gm], "decode_s": [x.decode_s for x in gm],
            "decode_tps": [x.decode_tokens / x.decode_s for x in gm],
            **g.acceptance(), **divergence(g.tokens, ref),
            "rounds_detail": _round_table(prof or g)}
    if gb:
        item["base"] = {"tokens_equal_method": gb[0].tokens == g.tokens,
                        "prefill_s": [x.prefill_s for x in gb], "decode_s": [x.decode_s for x in gb],
                        "decode_tps": [x.decode_tokens / x.decode_s for x in gb]}
    return item


def _summary(items: list[dict], reps_m: list[list[Generation]], reps_b: list[list[Generation]] | None) -> dict:
    tps_m = [_tps(gens) for gens in reps_m]
    out = {"decode_tps": statistics.median(tps_m), "decode_tps_reps": tps_m,
           "prompts": len(items), "tokens": sum(i["n_tokens"] for i in items)}
    rounds = sum(i["rounds"] for i in items)
    drafted = sum(i["drafted"] for i in items)
    out["tau"] = sum(i["n_tokens"] - 1 for i in items) / rounds if rounds else None
    out["acceptance_rate"] = sum(i["accepted"] for i in items) / drafted if drafted else None
    out["diverged_prompts"] = sum(i["first_divergence"] is not None for i in items)
    firsts = [i["first_divergence"] for i in items if i["first_divergence"] is not None]
    out["earliest_divergence"] = min(firsts) if firsts else None
    out["matched_fraction"] = statistics.mean(i["matched_fraction"] for i in items)
    if reps_b:
        tps_b = [_tps(gens) for gens in reps_b]
        ratios = [m / b for m, b in zip(tps_m, tps_b)]
        out.update({"base_decode_tps": statistics.median(tps_b), "base_decode_tps_reps": tps_b,
                    "speedup": statistics.median(ratios), "speedup_reps": ratios})
    else:
        out.update({"base_decode_tps": out["decode_tps"], "speedup": 1.0})
    return out
