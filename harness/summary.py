"""A cell's summary and speedup model, from plain numbers: the record's per-prompt items
(dicts) and, per rep, each prompt's token counts and seconds (Generation.tally).

No MLX and no engines here, directly or through what this imports: the report recomputes
phase means and the speedup over prompts from records with these same functions, and reads
records only.
"""

from __future__ import annotations

import statistics

from harness import stats
from harness.bounds import interpolate

MODEL_PHASES = ("verify",)  # phases the speedup model takes from calibration, not the profile


def _tps(rep: list[dict]) -> float:
    # decode tok/s of one rep, pooled over its prompts (tallies)
    secs = sum(g["decode_s"] for g in rep)
    return sum(g["decode_tokens"] for g in rep) / secs if secs > 0 else float("nan")


def _e2e_tps(rep: list[dict]) -> float:
    secs = sum(g["prefill_s"] + g["decode_s"] for g in rep)
    return sum(g["tokens"] for g in rep) / secs if secs > 0 else float("nan")


def _ms_median(reps: list[list[dict]]) -> float:
    return 1e3 * statistics.median(g["prefill_s"] for rep in reps for g in rep)


def cell_summary(items: list[dict], reps_m: list[list[dict]], reps_b: list[list[dict]] | None) -> dict:
    """The record's summary: `items` its per-prompt list, `reps_m` / `reps_b` per rep the method's
    and the reference's tallies, one per prompt (turn); reps_b None when the method is the reference."""
    out = _rates(items, reps_m)
    out.update(_acceptance(items))
    out.update(_costs(items, paired=bool(reps_b)))
    out["estimator"] = stats.ESTIMATOR
    out.update(_paired(items, reps_m, reps_b) if reps_b else _unpaired(out))
    return out


def _rates(items: list[dict], reps_m: list[list[dict]]) -> dict:
    tps_m = [_tps(rep) for rep in reps_m]
    return {"decode_tps": statistics.median(tps_m), "decode_tps_reps": tps_m,
            "decode_sigma_pct": stats.sigma_pct(tps_m), "prompts": len(items),
            "tokens": sum(i["n_tokens"] for i in items), "reps": len(tps_m),
            "ttft_ms": _ms_median(reps_m), "e2e_tps": statistics.median(_e2e_tps(rep) for rep in reps_m)}


def _acceptance(items: list[dict]) -> dict:
    out = {}
    rounds = sum(i["rounds"] for i in items)
    drafted = sum(i["drafted"] for i in items)
    out["tau"] = sum(i["n_tokens"] - 1 for i in items) / rounds if rounds else None
    out["acceptance_rate"] = sum(i["accepted"] for i in items) / drafted if drafted else None
    k = max((len(i["proposed_at"]) for i in items), default=0)
    proposed = [sum(i["proposed_at"][j] for i in items if j < len(i["proposed_at"])) for j in range(k)]
    accepted = [sum(i["accepted_at"][j] for i in items if j < len(i["accepted_at"])) for j in range(k)]
    out["per_position_acceptance"] = [a / p if p else None for a, p in zip(accepted, proposed)]
    out["diverged_prompts"] = sum(i["first_divergence"] is not None for i in items)
    firsts = [i["first_divergence"] for i in items if i["first_divergence"] is not None]
    out["earliest_divergence"] = min(firsts) if firsts else None
    out["matched_fraction"] = statistics.mean(i["matched_fraction"] for i in items)
    out["nondeterministic_prompts"] = sum(not i["deterministic"] for i in items)
    trees = [i["tree_size_mean"] for i in items if i.get("tree_size_mean")]
    out["tree_size_mean"] = statistics.mean(trees) if trees else None
    reads = [i.get("host_reads") for i in items]
    # the loop's host reads per round, and the share of rounds queued before their predecessor was read
    out["host_reads_per_round"] = sum(reads) / rounds if rounds and None not in reads else None
    out["read_ahead_fraction"] = sum(i.get("read_ahead", 0) for i in items) / rounds if rounds else None
    return out


def _costs(items: list[dict], paired: bool) -> dict:
    # outliers, the typical round and memory; the reference arm's too when there is one
    out = {"outlier_reps": sum(len(i["outlier_reps"]) + len(i.get("base", {}).get("outlier_reps", [])) for i in items),
           "round_ms_median": statistics.median(i["round_ms_median"] for i in items),
           "peak_memory_bytes": max(i["peak_memory_bytes"] for i in items),
           "cache_bytes": max(i["cache_bytes"] for i in items)}
    if paired:
        out["base_round_ms_median"] = statistics.median(i["base"]["round_ms_median"] for i in items)
        out["base_peak_memory_bytes"] = max(i["base"]["peak_memory_bytes"] for i in items)
        out["base_cache_bytes"] = max(i["base"]["cache_bytes"] for i in items)
    return out


def _paired(items: list[dict], reps_m: list[list[dict]], reps_b: list[list[dict]]) -> dict:
    # the speedups: per rep (stats.Paired), end to end, and over prompts
    tps_m, tps_b = [_tps(rep) for rep in reps_m], [_tps(rep) for rep in reps_b]
    paired = stats.Paired(tps_m, tps_b).summary()
    out = {"base_decode_tps": paired["reference_tps_median"], "base_decode_tps_reps": tps_b,
           "base_sigma_pct": paired["reference_sigma_pct"], "speedup": paired["speedup"],
           "speedup_reps": paired["ratio_reps"], "ratio_of_medians": paired["ratio_of_medians"],
           "speedup_ci_low": paired["speedup_ci_low"], "speedup_ci_high": paired["speedup_ci_high"],
           "base_ttft_ms": _ms_median(reps_b)}
    e2e = stats.Paired([_e2e_tps(rep) for rep in reps_m], [_e2e_tps(rep) for rep in reps_b]).summary()
    out.update(base_e2e_tps=e2e["reference_tps_median"], e2e_speedup=e2e["speedup"],
               e2e_speedup_ci_low=e2e["speedup_ci_low"], e2e_speedup_ci_high=e2e["speedup_ci_high"])
    out.update(prompt_spread(items))
    return out


def also_summary(items: list[dict], reps_m: list[list[dict]], reps_a: list[list[dict]]) -> dict:
    """The method against the second reference timed in the same reps (arms.also): its paired
    speedup over reps and over prompts, its tok/s and whether its tokens left the reference's."""
    tps_m, tps_a = [_tps(rep) for rep in reps_m], [_tps(rep) for rep in reps_a]
    paired = stats.Paired(tps_m, tps_a).summary()
    over = stats.geo_mean_interval([stats.geo_mean([m / a for m, a in zip(i["decode_tps"], i["also"]["decode_tps"],
                                                                          strict=True)]) for i in items])
    return {"decode_tps": paired["reference_tps_median"], "speedup": paired["speedup"],
            "speedup_ci_low": paired["speedup_ci_low"], "speedup_ci_high": paired["speedup_ci_high"],
            "speedup_prompts": over[0], "speedup_prompts_ci_low": over[1], "speedup_prompts_ci_high": over[2],
            "diverged_prompts": sum(i["also"]["first_divergence"] is not None for i in items)}


def _unpaired(out: dict) -> dict:
    # the method is its own reference: speedup 1 by definition, without an interval
    return {"base_decode_tps": out["decode_tps"], "base_sigma_pct": out["decode_sigma_pct"],
            "speedup": 1.0, "ratio_of_medians": 1.0, "speedup_ci_low": None, "speedup_ci_high": None,
            "base_ttft_ms": out["ttft_ms"], "base_e2e_tps": out["e2e_tps"], "e2e_speedup": 1.0,
            "e2e_speedup_ci_low": None, "e2e_speedup_ci_high": None}


def prompt_ratio(item: dict) -> float:
    """One prompt's (turn's) paired speedup: the geometric mean over its reps of method over
    reference decode tok/s, read from its record item."""
    return stats.geo_mean([m / b for m, b in zip(item["decode_tps"], item["base"]["decode_tps"], strict=True)])


def prompt_spread(items: list[dict]) -> dict:
    """The speedup over prompts: the geometric mean of the per-prompt (per-turn) paired
    ratios and its interval, which covers prompt-to-prompt spread (stats module docstring)."""
    point, lo, hi = stats.geo_mean_interval([prompt_ratio(i) for i in items])
    return {"speedup_prompts": point, "speedup_prompts_ci_low": lo, "speedup_prompts_ci_high": hi,
            "speedup_prompts_n": len(items)}


def base_step(items: list[dict]) -> dict | None:
    """Mean ms of the profiled base arm's round (one decode step) and of its verify phase."""
    means = phase_means([i["base_profile"] for i in items if i.get("base_profile")])
    if not means:
        return None
    return {"round_ms": sum(means.values()), "verify_ms": means.get("verify", 0.0)}


def phase_means(items: list[dict], key: str = "phase_ms") -> dict[str, float]:
    """Mean ms per round of each profiled phase, over every profiled round of the cell; key
    "phase_host_ms": of each phase's host time before its barrier (records since 2026-12-05)."""
    totals: dict[str, float] = {}
    rounds = 0
    for i in items:
        phases = i["rounds_detail"].get(key)
        if not phases:
            continue
        rounds += len(i["rounds_detail"]["drafted"])
        for p, ms in phases.items():
            totals[p] = totals.get(p, 0.0) + sum(ms)
    return {p: t / rounds for p, t in totals.items()} if rounds else {}


def _profiled_rounds(items: list[dict]) -> tuple[dict[int, list[int]], int]:
    # Per drafted K, the tokens each of its rounds fed the verify besides the pending one (a
    # tree feeds all its nodes, a chain its K drafts); and the tokens the rounds yielded.
    fed: dict[int, list[int]] = {}
    tokens = 0
    for i in items:
        detail = i["rounds_detail"]
        tokens += sum(detail["emitted"]) if "emitted" in detail else sum(detail["accepted"]) + len(detail["accepted"])
        for k, v in zip(detail["drafted"], detail.get("tree_size") or detail["drafted"]):
            fed.setdefault(k, []).append(v)
    return fed, tokens


def speedup_model(items: list[dict], summary: dict, calibration: dict | None, block: int,
                  incremental: bool = True, full_block: bool = False) -> dict | None:
    """Predicted speedup of the profiled rounds from component costs (harness/stats).

    Unit: one base decode step as the timed base arm runs it (its median step: pipelined,
    each step queued before the last token is read); without timed base rounds, the
    profiled base step, or the calibrated single-token verify where no base arm was
    profiled. A round costs the calibrated verify ratio (tokens it fed over 1: K+1 for a
    chain, nodes+1 for a tree) times the profiled base step's verify, plus the method's
    other profiled phases: a drafting round waits on the host once anyway, so its
    profile is what it costs. `full_block`: the method verifies the whole block every
    round whatever it drafted (the control)."""
    if calibration is None or block < 2:
        return None
    phases = phase_means(items)
    out = {"k": block - 1, "acceptance": summary["acceptance_rate"],
           "verify_cost_ratio": calibration["verify_cost_ratio"]}
    if not phases:
        return out  # without a profile the cost of drafting is unknown
    ratio = {int(t): ms / calibration["decode_ms"] for t, ms in calibration["verify_ms_by_tokens"].items()}
    cost = lambda t: interpolate(ratio, t)  # noqa: E731 -- sizes between timed ones lie on a line
    base = base_step(items)
    timed = summary.get("base_round_ms_median") if base else None
    unit = timed or (base["round_ms"] if base else calibration["decode_ms"])
    verify1 = base["verify_ms"] if base else calibration["decode_ms"]
    overhead = sum(ms for p, ms in phases.items() if p not in MODEL_PHASES)
    fed, tokens = _profiled_rounds(items)
    if incremental:
        verify = {k: statistics.mean(cost(block if full_block else min(v + 1, block)) for v in vs) * verify1
                  for k, vs in fed.items()}
    else:  # the method's verify is not the target's incremental one (dflash_c re-prefills): take it as profiled
        verify = {k: phases.get("verify", 0.0) for k in fed}
    counts = {k: len(vs) for k, vs in fed.items()}
    mix = stats.RoundMix(counts, {k: (verify[k] + overhead) / unit for k in fed})
    rounds = sum(counts.values())
    out.update({"unit_ms": unit, "unit": "timed base step" if timed else "base profile" if base else "calibration",
                "overhead_ms": overhead,
                # what pipelining saves the base arm: its profiled (unpipelined) step over its timed one
                "base_pipelining_gain": base["round_ms"] / timed if timed else None,
                "round_cost_ratio": mix.total_cost() / rounds, "break_even_tau": mix.total_cost() / rounds,
                "profiled_tau": tokens / rounds, "iid_acceptance": mix.iid_acceptance(tokens),
                "drafted_rounds": {str(k): n for k, n in sorted(counts.items())},
                "predicted_speedup": mix.speedup_for_tokens(tokens),
                "break_even_acceptance": mix.break_even_acceptance()})
    return out
