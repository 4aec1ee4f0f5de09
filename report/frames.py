"""Records -> pandas DataFrames. The report reads records only, never live state."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd

from harness import stats
from harness.records import iter_records
from harness.summary import phase_means, prompt_spread

CELL_COLUMNS = ["arch", "method", "block_size", "kv", "reference", "status", "base_decode_tps", "decode_tps", "speedup",
                "speedup_ci_low", "speedup_ci_high", "speedup_prompts", "speedup_prompts_ci_low",
                "speedup_prompts_ci_high", "e2e_speedup", "e2e_speedup_ci_low", "e2e_speedup_ci_high",
                "base_ttft_ms", "ttft_ms", "base_e2e_tps", "e2e_tps", "ratio_of_medians", "base_sigma_pct", "decode_sigma_pct",
                "tau", "acceptance_rate", "per_position_acceptance", "diverged_prompts", "prompts",
                "earliest_divergence", "matched_fraction", "predicted_speedup", "break_even_acceptance",
                "verify_cost_ratio", "round_cost_ratio", "iid_acceptance", "weight_bytes", "stream_gbs",
                "ceiling_tps", "reps", "reason", "model_type", "dtype", "rollback", "backend", "blas_kind",
                "cell_id", "path"]


def model_dtype(rec: dict) -> str | None:
    """The weights' dtype as a table names it: float dtype, plus q<bits> for a quantized checkpoint."""
    model = rec.get("model", {})
    q = model.get("quantization")
    return f"{model.get('dtype')} q{q['bits']}" if q else model.get("dtype")


def _records(root: Path) -> list[tuple[Path, dict]]:
    return list(iter_records(root))


def arch_labels(records) -> dict[str, str]:
    """cell id -> the arch's row label: its name, plus the checkpoint and dtype where
    records under one arch name differ in them (a fixture and a real checkpoint, or
    float32 and bf16 runs, must never share a table)."""
    seen: dict[str, set] = {}
    for _, rec in records:
        model = rec.get("model", {})
        if model:  # a cell refused before its model loaded (no drafter) joins the table of its arch
            seen.setdefault(rec["cell"]["arch"]["name"], set()).add((model.get("path"), model_dtype(rec)))
    for _, rec in records:
        seen.setdefault(rec["cell"]["arch"]["name"], {(None, None)})
    labels = {}
    for _, rec in records:
        name, model = rec["cell"]["arch"]["name"], rec.get("model", {})
        variants = seen[name]
        if not model and len(variants) == 1:
            model = {"path": next(iter(variants))[0]}
        parts = []
        if len({p for p, _ in variants}) > 1:
            parts.append(Path(model.get("path") or "?").name)
        if len({d for _, d in variants}) > 1:
            parts.append(model_dtype(rec) or "?")
        labels[rec["cell_id"]] = f"{name} [{', '.join(parts)}]" if parts else name
    return labels


def bench_labels(records) -> dict[str, str]:
    """cell id -> the bench settings that tell it from other cells of its arch ('' where all
    share them): merged runs of two suites, or two token budgets, must not make rows that look
    identical."""
    by_arch: dict[str, list[tuple[str, dict]]] = {}
    for _, rec in records:
        by_arch.setdefault(rec["cell"]["arch"]["name"], []).append((rec["cell_id"], rec["cell"].get("bench") or {}))
    out = {}
    for group in by_arch.values():
        keys = sorted({k for _, b in group for k in b})
        varying = [k for k in keys if len({json.dumps(b.get(k), sort_keys=True) for _, b in group}) > 1]
        for cid, b in group:
            out[cid] = ", ".join(f"{k}={b.get(k)}" for k in varying)
    return out


def cell_labels(records) -> dict[str, tuple[str, str]]:
    """cell id -> (arch label, bench label): what `_keys` needs to name a cell in any frame."""
    arch, bench = arch_labels(records), bench_labels(records)
    return {cid: (arch[cid], bench[cid]) for cid in arch}


def _keys(rec: dict, labels: dict[str, tuple[str, str]]) -> dict:
    # The columns that name a cell in every frame.
    cell = rec["cell"]
    arch, bench = labels[rec["cell_id"]]
    method = cell["method"].get("label") or cell["method"]["name"]
    if cell.get("reference") not in (None, "base"):
        method += f" vs {cell['reference']}"  # paired against another method, not base
    if cell.get("dispatch"):  # set on the command line: cells that differ only in it must not look alike
        method += " [" + ", ".join(f"{k}={v}" for k, v in sorted(cell["dispatch"].items())) + "]"
    if bench:
        method += f" ({bench})"
    return {"arch": arch, "method": method,
            "block_size": cell["method"].get("block_size"), "kv": cell["kv"]["name"]}


def cells(root: Path, records=None) -> pd.DataFrame:
    """One row per recorded cell."""
    records = records if records is not None else _records(root)
    labels = cell_labels(records)
    rows = []
    for path, rec in records:
        env, summary = rec.get("env", {}), rec.get("summary", {})
        row = {**_keys(rec, labels), "reference": rec["cell"].get("reference") or "base",
               "status": rec.get("status"), "reason": rec.get("reason"),
               "model_type": rec.get("model", {}).get("model_type"), "dtype": model_dtype(rec),
               "rollback": rec.get("engine", {}).get("rollback"), "backend": env.get("backend"),
               "blas_kind": env.get("blas_kind"), "host": env.get("host"),
               "other_cpu_share": (rec.get("load") or {}).get("other_cpu_share"),
               "cell_id": rec["cell_id"], "path": str(path)}
        row.update({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
        row["per_position_acceptance"] = summary.get("per_position_acceptance")
        ceiling = rec.get("ceiling") or {}
        row.update({"weight_bytes": ceiling.get("weight_bytes"), "stream_gbs": ceiling.get("stream_gbs"),
                    "ceiling_tps": ceiling.get("tps")})
        model = summary.get("model") or {}
        row.update({k: model.get(k) for k in ("predicted_speedup", "break_even_acceptance", "verify_cost_ratio",
                                              "round_cost_ratio", "iid_acceptance", "base_pipelining_gain")})
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in CELL_COLUMNS:
        if col not in df:
            df[col] = None
    df["block_size"] = df["block_size"].astype("Int64")
    return df[CELL_COLUMNS + [c for c in df.columns if c not in CELL_COLUMNS]]


def prompts(root: Path, records=None) -> pd.DataFrame:
    """One row per (cell, prompt, turn) of the cells that ran."""
    records = records if records is not None else _records(root)
    labels = cell_labels(records)
    rows = []
    for _, rec in records:
        for item in rec.get("prompts", []):
            row = {**_keys(rec, labels), "cell_id": rec["cell_id"],
                   **{k: v for k, v in item.items() if not isinstance(v, (list, dict))}}
            row.update({f"divergence_{k}": v for k, v in (item.get("divergence") or {}).items()})
            rows.append(row)
    return pd.DataFrame(rows)


def profiles(records) -> pd.DataFrame:
    """Mean ms per round of each phase, one row per cell that was profiled."""
    labels = cell_labels(records)
    rows = []
    for _, rec in records:
        if rec.get("status") != "ok":
            continue
        means = phase_means(rec.get("prompts", []))
        if means:
            rows.append({**_keys(rec, labels), "cell_id": rec["cell_id"], **means})
    return pd.DataFrame(rows)


def accept_hists(records) -> pd.DataFrame:
    """Accepted drafts per round, summed over a cell's prompts: one row per (cell, n_accepted)."""
    labels = cell_labels(records)
    rows = []
    for _, rec in records:
        items = rec.get("prompts", [])
        if rec.get("status") != "ok" or not any(sum(i["accept_hist"][1:]) or i["drafted"] for i in items):
            continue
        width = max(len(i["accept_hist"]) for i in items)
        total = [sum(i["accept_hist"][n] for i in items if n < len(i["accept_hist"])) for n in range(width)]
        for n, count in enumerate(total):
            rows.append({**_keys(rec, labels), "accepted": n, "rounds": count})
    return pd.DataFrame(rows)


ALL = "all"  # the category row of a cell's every prompt: the same estimators over the whole cell

CATEGORY_COLUMNS = ["arch", "method", "block_size", "kv", "reference", "category", "prompts", "turns", "tokens",
                    "base_decode_tps", "decode_tps", "speedup", "speedup_ci_low", "speedup_ci_high",
                    "speedup_prompts", "speedup_prompts_ci_low", "speedup_prompts_ci_high",
                    "ratio_of_medians", "tau", "acceptance_rate", "per_position_acceptance", "rounds", "drafted",
                    "accepted", "reps", "cell_id"]


def categories(records) -> pd.DataFrame:
    """One row per (cell that ran, prompt category), categories in the order the suite has
    them, after a row for the whole cell (category "all"): see `category_summary`."""
    labels = cell_labels(records)
    rows = []
    for _, rec in records:
        items = rec.get("prompts", [])
        if rec.get("status") != "ok" or not items:
            continue
        groups = {ALL: items}
        label = category_labels(items)
        for i in items:
            groups.setdefault(label(i), []).append(i)
        unobserved = (rec.get("summary") or {}).get("acceptance_unobserved")  # tokens per step inferred: no tau to show
        for cat, group in groups.items():
            summary = category_summary(group)
            if unobserved:
                summary.update(tau=None, acceptance_rate=None, per_position_acceptance=None)
            rows.append({**_keys(rec, labels), "reference": rec["cell"].get("reference") or "base",
                         "category": cat, **summary, "cell_id": rec["cell_id"]})
    df = pd.DataFrame(rows, columns=CATEGORY_COLUMNS)
    df["block_size"] = df["block_size"].astype("Int64")
    return df


def category_labels(items: list[dict]):
    """A function naming an item's category: the category alone, or `suite:category` where two
    suites of the record use the same name (MT-Bench's math and GSM8K's)."""
    suites: dict[str, set] = {}
    for i in items:
        suites.setdefault(i["category"], set()).add(i.get("suite", ""))
    return lambda i: f"{i.get('suite', '')}:{i['category']}" if len(suites[i["category"]]) > 1 else i["category"]


def _rep_tps(timings: list[dict]) -> list[float]:
    # Per rep: decode tokens over decode seconds summed over the prompts (each prompt's tokens of a rep
    # are its tok/s times its seconds): the estimator of the record's own summary, on any subset of prompts.
    reps = min(len(t["decode_s"]) for t in timings)
    out = []
    for r in range(reps):
        secs = sum(t["decode_s"][r] for t in timings)
        tokens = sum(round(t["decode_tps"][r] * t["decode_s"][r]) for t in timings if t["decode_s"][r] > 0)
        out.append(tokens / secs if secs > 0 else float("nan"))
    return out


def category_summary(items: list[dict]) -> dict:
    """tok/s, paired speedup, tau and acceptance of a group of a cell's per-prompt items.

    tok/s per arm: per rep, the group's decode tokens over its decode time, median over
    reps. Speedup: per rep, method tok/s over reference tok/s of the same rep (a ratio of
    summed tokens over summed time per arm), their geometric mean and its 95% t-interval
    on the log ratios (timing noise); speedup_prompts: the same estimator over the
    group's per-prompt ratios (prompt-to-prompt spread). Over all of a cell's items these
    are the record's summary numbers.
    tau = decode tokens / rounds; acceptance = accepted / drafted drafts."""
    tps_m = _rep_tps(items)
    out = {"prompts": len({i["id"] for i in items}), "turns": len(items), "tokens": sum(i["n_tokens"] for i in items),
           "reps": len(tps_m), "decode_tps": statistics.median(tps_m)}
    if all("base" in i for i in items):
        paired = stats.Paired(tps_m, _rep_tps([i["base"] for i in items])).summary()
        out.update(base_decode_tps=paired["reference_tps_median"], speedup=paired["speedup"],
                   speedup_ci_low=paired["speedup_ci_low"], speedup_ci_high=paired["speedup_ci_high"],
                   ratio_of_medians=paired["ratio_of_medians"])
        out.update(prompt_spread(items))
    else:  # the method is its own reference (a base cell)
        out.update(base_decode_tps=out["decode_tps"], speedup=1.0, speedup_ci_low=None, speedup_ci_high=None,
                   ratio_of_medians=1.0)
    rounds, drafted = sum(i["rounds"] for i in items), sum(i["drafted"] for i in items)
    accepted = sum(i["accepted"] for i in items)
    k = max((len(i["proposed_at"]) for i in items), default=0)
    proposed_at = [sum(i["proposed_at"][j] for i in items if j < len(i["proposed_at"])) for j in range(k)]
    accepted_at = [sum(i["accepted_at"][j] for i in items if j < len(i["accepted_at"])) for j in range(k)]
    out.update(rounds=rounds, drafted=drafted, accepted=accepted,
               tau=sum(i["n_tokens"] - 1 for i in items) / rounds if rounds else None,
               acceptance_rate=accepted / drafted if drafted else None,
               per_position_acceptance=[a / n if n else None for a, n in zip(accepted_at, proposed_at)])
    return out


def outside_arms(records) -> pd.DataFrame:
    """One row per arm implemented outside the harness's engines (a reference implementation,
    an engine process, a server): which implementation, its version and command, what it could
    not show. Read from the records' `engine` and `reference_engine` descriptions."""
    rows = []
    for _, rec in records:
        for arm, d in (("method", rec.get("engine")), ("reference", rec.get("reference_engine"))):
            if isinstance(d, dict) and d.get("implementation"):
                m = rec["cell"]["method"]
                rows.append({"cell_id": rec["cell_id"], "method": m.get("label") or m["name"],
                             "reference": rec["cell"].get("reference") or "base", "arm": arm,
                             "implementation": d["implementation"], "version": d.get("version"),
                             "launch": d.get("launch") or d.get("command"), "observed": d.get("observed"),
                             "status": rec.get("status")})
    return pd.DataFrame(rows, columns=["cell_id", "method", "reference", "arm", "implementation", "version",
                                       "launch", "observed", "status"])

