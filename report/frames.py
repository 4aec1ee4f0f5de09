"""Records -> pandas DataFrames. The report reads records only, never live state."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
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
    model = rec.get("model") or {}
    q = model.get("quantization")
    return f"{model.get('dtype')} q{q.get('bits')}" if q else model.get("dtype")


def _records(root: Path) -> list[tuple[Path, dict]]:
    return list(iter_records(root))


def arch_labels(records) -> dict[str, str]:
    """cell id -> the arch's row label: its name, plus the checkpoint and dtype where
    records under one arch name differ in them (a fixture and a real checkpoint, or
    float32 and bf16 runs, must never share a table)."""
    seen: dict[str, set] = {}
    for _, rec in records:
        model = rec.get("model") or {}
        if model:  # a cell refused before its model loaded (no drafter) joins the table of its arch
            seen.setdefault(rec["cell"]["arch"]["name"], set()).add((model.get("path"), model_dtype(rec)))
    for _, rec in records:
        seen.setdefault(rec["cell"]["arch"]["name"], {(None, None)})
    labels = {}
    for _, rec in records:
        name, model = rec["cell"]["arch"]["name"], rec.get("model") or {}
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


# Bench keys added after records were first written, and the value an older record ran with.
BENCH_DEFAULTS = {"context": 0}


def bench_of(rec: dict) -> dict:
    """The cell's bench config, with the defaults of keys its record predates."""
    return {**BENCH_DEFAULTS, **(rec["cell"].get("bench") or {})}


def sampled(bench: dict) -> bool:
    """Whether the cell samples (temperature > 0): its outputs leave the greedy output by design."""
    return (bench.get("temperature") or 0) > 0


# Bench keys that mean something only in some cells (the harness writes context_source and context_reuse only
# with a context): compared, and named, only where they apply.
APPLIES = {"context_source": lambda b: (b.get("context") or 0) > 0, "context_reuse": lambda b: (b.get("context") or 0) > 0}


def _applies(key: str, bench: dict) -> bool:
    return APPLIES.get(key, lambda b: True)(bench)


def _bench_item(key: str, value) -> str:
    if key == "temperature":  # a sampled cell says so wherever it is named
        return f"T={float(value or 0)}" + (", sampled" if (value or 0) > 0 else "")
    return f"{key}={value}"


def bench_labels(records, leave_out: tuple[str, ...] = ()) -> dict[str, str]:
    """cell id -> the bench settings that tell it from other cells of its arch ('' where all
    share them): merged runs of two suites, or two token budgets, must not make rows that look
    identical. Where any cell of the arch samples, every cell of it names its temperature
    ("T=1.0, sampled"), varying or not. A key that applies to some cells only (`APPLIES`) is
    compared and named among those. `leave_out`: keys a table shows in columns of their own."""
    return bench_label_sets(records, [leave_out])[0]


def bench_label_sets(records, leave_outs: list[tuple[str, ...]]) -> list[dict[str, str]]:
    """`bench_labels` for each of `leave_outs`, each setting compared over the cells once."""
    by_arch: dict[str, list[tuple[str, dict]]] = {}
    for _, rec in records:
        by_arch.setdefault(rec["cell"]["arch"]["name"], []).append((rec["cell_id"], bench_of(rec)))
    outs: list[dict[str, str]] = [{} for _ in leave_outs]
    for group in by_arch.values():
        any_sampled = any(sampled(b) for _, b in group)
        varying = [k for k in sorted({k for _, b in group for k in b}) if (k == "temperature" and any_sampled)
                   or len({json.dumps(b.get(k), sort_keys=True) for _, b in group if _applies(k, b)}) > 1]
        for out, leave_out in zip(outs, leave_outs):
            shown = [k for k in varying if k not in leave_out]
            for cid, b in group:
                out[cid] = ", ".join(_bench_item(k, b.get(k)) for k in shown if _applies(k, b))
    return outs


def cell_labels(records, leave_out: tuple[str, ...] = ()) -> dict[str, tuple[str, str]]:
    """cell id -> (arch label, bench label): what `_keys` needs to name a cell in any frame;
    `leave_out` as for `bench_labels`."""
    return cell_label_sets(records, [leave_out])[0]


def cell_label_sets(records, leave_outs: list[tuple[str, ...]]) -> list[dict[str, tuple[str, str]]]:
    """`cell_labels` for each of `leave_outs`, the arch labels made once."""
    arch = arch_labels(records)
    return [{cid: (arch[cid], bench[cid]) for cid in arch} for bench in bench_label_sets(records, leave_outs)]


def _keys(rec: dict, labels: dict[str, tuple[str, str]]) -> dict:
    # The columns that name a cell in every frame.
    cell = rec["cell"]
    arch, bench = labels[rec["cell_id"]]
    method = cell["method"].get("label") or cell["method"]["name"]
    if cell.get("reference") not in (None, "base"):
        method += f" vs {cell['reference']}"  # paired against another method, not base
    if cell.get("dispatch"):  # set on the command line: cells that differ only in it must not look alike
        method += " [" + ", ".join(f"{k}={v}" for k, v in sorted(cell["dispatch"].items())) + "]"
    if cell.get("execution") not in (None, "eager"):  # rounds that stay on the device (engines/methods/device.py)
        method += f" [{cell['execution']}]"
    forced = _forced_setting(rec)
    if forced:  # a chosen acceptance (engines/runtime/forced.py): not the drafter's
        method += f" [forced {forced}]"
    threshold = cell["method"].get("draft_threshold")
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):  # adaptive draft length
        method += f" [drafts while p >= {threshold:g}]"
    if cell["method"].get("draft_bandit") is True:  # adaptive draft length: K picked each round
        method += " [K by bandit]"
    for name, value in sorted((cell["method"].get("options") or {}).items()):  # a method's own settings, off default
        method += f" [{name}={str(value).lower() if isinstance(value, bool) else value}]"
    if cell["method"].get("workload") is False:  # suffix records from before method options (2026-12-07)
        method += " [request only]"
    if bench:
        method += f" ({bench})"
    return {"arch": arch, "method": method,
            "block_size": cell["method"].get("block_size"), "kv": cell["kv"]["name"]}


def _items(rec: dict) -> list[dict]:
    return rec.get("prompts") or []


def _profiled(items: list[dict]) -> list[dict]:
    # The items phase_means can read: those with per-round data (a damaged record may lack it).
    return [i for i in items if i.get("rounds_detail")]


def cells(root: Path, records=None) -> pd.DataFrame:
    """One row per recorded cell."""
    records = records if records is not None else _records(root)
    labels = cell_labels(records)
    return cells_frame([cell_row(path, rec, labels) for path, rec in records])


def cell_row(path, rec: dict, labels) -> dict:
    """One record's `cells` row."""
    env, summary = rec.get("env") or {}, rec.get("summary") or {}
    row = {**_keys(rec, labels), "reference": rec["cell"].get("reference") or "base",
           "status": rec.get("status"), "reason": rec.get("reason"),
           "model_type": (rec.get("model") or {}).get("model_type"), "dtype": model_dtype(rec),
           "rollback": (rec.get("engine") or {}).get("rollback"), "backend": env.get("backend"),
           "blas_kind": env.get("blas_kind"), "host": env.get("host"),
           "other_cpu_share": (rec.get("load") or {}).get("other_cpu_share"),
           "temperature": bench_of(rec).get("temperature"), "context": bench_of(rec)["context"],
           "forced": bool(rec["cell"]["method"].get("force")), "forced_setting": _forced_setting(rec),
           "method_name": rec["cell"]["method"]["name"], "cell_id": rec["cell_id"], "path": str(path)}
    row.update({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
    row["per_position_acceptance"] = summary.get("per_position_acceptance")
    also = summary.get("also") if isinstance(summary.get("also"), dict) else {}
    row.update({f"also_{k}": v for k, v in also.items() if not isinstance(v, (list, dict))})
    ceiling = rec.get("ceiling") or {}
    row.update({"weight_bytes": ceiling.get("weight_bytes"), "stream_gbs": ceiling.get("stream_gbs"),
                "ceiling_tps": ceiling.get("tps")})
    model = summary.get("model") or {}
    row.update({k: model.get(k) for k in ("predicted_speedup", "break_even_acceptance", "verify_cost_ratio",
                                          "round_cost_ratio", "iid_acceptance", "base_pipelining_gain",
                                          "break_even_tau")})
    return row


def _forced_setting(rec: dict) -> str | None:
    # "3 a round" / "rate 0.7": what a forced cell was told to accept (engines/runtime/forced.py); None where not forced.
    force = rec["cell"]["method"].get("force")
    if not isinstance(force, dict) or not force:
        return None
    return f"{force['accepted']} a round" if "accepted" in force else f"rate {force.get('rate')}"


def cells_frame(rows: list[dict]) -> pd.DataFrame:
    """The `cells` frame of `cell_row`s: CELL_COLUMNS first, then whatever else the summaries hold."""
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
    return pd.DataFrame([row for _, rec in records for row in prompt_rows(rec, labels)])


def prompt_rows(rec: dict, labels) -> list[dict]:
    """One record's `prompts` rows: its items' scalars and divergence, under the cell's name."""
    rows = []
    for item in _items(rec):
        row = {**_keys(rec, labels), "cell_id": rec["cell_id"], "temperature": bench_of(rec).get("temperature"),
               **{k: v for k, v in item.items() if not isinstance(v, (list, dict))}}
        row.update({f"divergence_{k}": v for k, v in (item.get("divergence") or {}).items()})
        rows.append(row)
    return rows


def profiles(records, key: str = "phase_ms") -> pd.DataFrame:
    """Mean ms per round of each phase, one row per cell that was profiled; key "phase_host_ms":
    of each phase's host time before its barrier (cells recorded without it are left out)."""
    labels = cell_labels(records)
    return pd.DataFrame([row for _, rec in records for row in profile_rows(rec, labels, key)])


def profile_rows(rec: dict, labels, key: str = "phase_ms") -> list[dict]:
    """One record's `profiles` row, or none where it ran no profiled rounds."""
    if rec.get("status") != "ok":
        return []
    means = phase_means(_profiled(_items(rec)), key)
    return [{**_keys(rec, labels), "cell_id": rec["cell_id"], **means}] if means else []


def accept_hists(records) -> pd.DataFrame:
    """Accepted drafts per round, summed over a cell's prompts: one row per (cell, n_accepted)."""
    labels = cell_labels(records)
    return pd.DataFrame([row for _, rec in records for row in accept_hist_rows(rec, labels)])


def accept_hist_rows(rec: dict, labels) -> list[dict]:
    """One drafting record's `accept_hists` rows; none for a cell that drafted nothing."""
    items = _items(rec)
    if rec.get("status") != "ok" or not any(sum(i["accept_hist"][1:]) or i["drafted"] for i in items):
        return []
    width = max(len(i["accept_hist"]) for i in items)
    total = [sum(i["accept_hist"][n] for i in items if n < len(i["accept_hist"])) for n in range(width)]
    return [{**_keys(rec, labels), "accepted": n, "rounds": count} for n, count in enumerate(total)]


ALL = "all"  # the category row of a cell's every prompt: the same estimators over the whole cell
SUITE_PREFIX = "suite "  # a row of one suite's every prompt, where a cell mixes suites (`bench.suite=a+b`)

CATEGORY_COLUMNS = ["arch", "method", "block_size", "kv", "reference", "category", "prompts", "turns", "tokens",
                    "base_decode_tps", "decode_tps", "speedup", "speedup_ci_low", "speedup_ci_high",
                    "speedup_prompts", "speedup_prompts_ci_low", "speedup_prompts_ci_high",
                    "ratio_of_medians", "tau", "acceptance_rate", "per_position_acceptance", "rounds", "drafted",
                    "accepted", "reps", "cell_id"]


def categories(records) -> pd.DataFrame:
    """One row per (cell that ran, prompt category), categories in the order the suite has
    them, after a row for the whole cell (category "all"): see `category_summary`."""
    labels = cell_labels(records)
    return categories_frame([row for _, rec in records for row in category_rows(rec, labels)])


def category_rows(rec: dict, labels) -> list[dict]:
    """One record's `categories` rows: its whole cell, each suite where it mixes several
    (`suite <name>`: a suite's pooled interval, which its categories' intervals do not give),
    then each category its items hold."""
    items = _items(rec)
    if rec.get("status") != "ok" or not items:
        return []
    groups = {ALL: items}
    suites = list(dict.fromkeys(i.get("suite", "") for i in items))
    if len(suites) > 1:
        for s in suites:
            groups[SUITE_PREFIX + (s or "?")] = [i for i in items if i.get("suite", "") == s]
    label = category_labels(items)
    for i in items:
        groups.setdefault(label(i), []).append(i)
    unobserved = (rec.get("summary") or {}).get("acceptance_unobserved")  # tokens per step inferred: no tau to show
    rows = []
    for cat, group in groups.items():
        summary = category_summary(group)
        if unobserved:
            summary.update(tau=None, acceptance_rate=None, per_position_acceptance=None)
        rows.append({**_keys(rec, labels), "reference": rec["cell"].get("reference") or "base",
                     "category": cat, **summary, "cell_id": rec["cell_id"]})
    return rows


def categories_frame(rows: list[dict]) -> pd.DataFrame:
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
    return pd.DataFrame([row for _, rec in records for row in outside_rows(rec)], columns=OUTSIDE_COLUMNS)


OUTSIDE_COLUMNS = ["cell_id", "method", "reference", "arm", "implementation", "version", "launch", "observed", "status"]


def outside_rows(rec: dict) -> list[dict]:
    """One record's `outside_arms` rows: its method arm, its reference arm, or both."""
    rows = []
    for arm, d in (("method", rec.get("engine")), ("reference", rec.get("reference_engine"))):
        if isinstance(d, dict) and d.get("implementation"):
            m = rec["cell"]["method"]
            rows.append({"cell_id": rec["cell_id"], "method": m.get("label") or m["name"],
                         "reference": rec["cell"].get("reference") or "base", "arm": arm,
                         "implementation": d["implementation"], "version": d.get("version"),
                         "launch": d.get("launch") or d.get("command"), "observed": d.get("observed"),
                         "status": rec.get("status")})
    return rows


DEPTH_BIN = 16  # output tokens per depth bin: a few rounds of a block-8 method per prompt, many in a run


def round_emitted(detail: dict) -> list[int]:
    """Tokens each round emitted: the `emitted` column, or accepted + 1 in records written before it."""
    return detail["emitted"] if "emitted" in detail else [a + 1 for a in detail["accepted"]]


def round_positions(detail: dict) -> list[int]:
    """The output position (0-based index into the generated tokens) of each round's first
    emitted token: the record's `position` column, or, in records written before it, 1 + the
    tokens the earlier rounds emitted (token 0 is the prefill's, not a round's)."""
    emitted = round_emitted(detail)
    if "position" in detail:
        assert len(detail["position"]) == len(emitted), "rounds_detail: one position per round"
        return list(detail["position"])
    out, pos = [], 1
    for n in emitted:
        out.append(pos)
        pos += n
    return out


def depth_table(details: list[dict], width: int = DEPTH_BIN) -> list[dict]:
    """Rounds pooled by decode depth over `details` (a cell's rounds_detail columns, one per
    prompt and turn): one row per bin of `width` output positions that holds a round, in
    order. A round falls in the bin of its first emitted token's position. Each row: bin,
    depth_lo / depth_hi (its first and last position), rounds, emitted, drafted, accepted,
    tau = emitted / rounds, acceptance_rate = accepted / drafted (None where nothing was drafted)."""
    assert width >= 1, f"depth bin width must be >= 1 token, got {width}"
    bins: dict[int, list[int]] = {}  # bin -> [rounds, emitted, drafted, accepted]
    for d in details:
        for pos, e, k, a in zip(round_positions(d), round_emitted(d), d["drafted"], d["accepted"], strict=True):
            acc = bins.setdefault(pos // width, [0, 0, 0, 0])
            for j, v in enumerate((1, e, k, a)):
                acc[j] += v
    return [{"bin": b, "depth_lo": b * width, "depth_hi": (b + 1) * width - 1, "rounds": n, "emitted": e,
             "drafted": k, "accepted": a, "tau": e / n, "acceptance_rate": a / k if k else None}
            for b, (n, e, k, a) in sorted(bins.items())]


AXES = ("context", "temperature")  # bench axes the report reads along, each in a column of its own
DEPTH_COLUMNS = ["arch", "method", "block_size", "kv", "context", "temperature", "cell_id", "bin", "depth_lo",
                 "depth_hi", "rounds", "emitted", "drafted", "accepted", "tau", "acceptance_rate"]


def depth(records, width: int = DEPTH_BIN) -> pd.DataFrame:
    """One row per (cell that ran, depth bin): `depth_table` over the method arm's rounds of
    all the cell's prompts, the cell named without its context and temperature (columns of
    their own). Cells whose acceptance the record could not observe are left out."""
    labels = cell_labels(records, leave_out=AXES)
    return depth_frame([row for _, rec in records for row in depth_rows(rec, labels, width)])


def depth_rows(rec: dict, labels, width: int = DEPTH_BIN) -> list[dict]:
    """One record's `depth` rows (`labels` named without AXES)."""
    if rec.get("status") != "ok" or (rec.get("summary") or {}).get("acceptance_unobserved"):
        return []
    details = [i["rounds_detail"] for i in _items(rec) if i.get("rounds_detail")]
    bench = bench_of(rec)
    return [{**_keys(rec, labels), "context": bench["context"], "temperature": bench.get("temperature"),
             "cell_id": rec["cell_id"], **row} for row in depth_table(details, width)]


def depth_frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=DEPTH_COLUMNS)
    df["block_size"] = df["block_size"].astype("Int64")
    return df


def axis_values(records, axis: str) -> list:
    """The distinct values of bench `axis` over the cells that ran, sorted: the report reads
    along an axis only where it has more than one."""
    return sorted({bench_of(rec).get(axis) for _, rec in records if rec.get("status") == "ok"} - {None})


PHASE_PREFIX = "ms "  # an `along` column holding a phase's mean ms per round
ALONG_COLUMNS = ["arch", "method", "block_size", "kv", "{axis}", "cell_id", "paired", "speedup", "speedup_ci_low",
                 "speedup_ci_high", "tau", "acceptance_rate", "ttft_ms", "base_ttft_ms", "context_tokens",
                 "first_prefill_ms", "first_prepare_ms"]


def along(records, axis: str) -> pd.DataFrame:
    """One row per cell that ran, for reading bench `axis` (context, temperature): the cell
    named without that axis, so one method's cells line up across its values; the value in
    column `axis`; speedup and its reps CI, tau, acceptance, TTFT of both arms, the context
    tokens the prompts had (mean over them), whether the cell is paired with a reference, the
    method's profiled first token split into the target's prefill and its own context pass
    (prepare: a drafter's pass over the prompt), and one column per profiled phase ("ms verify":
    mean ms per round, `phase_means`)."""
    labels = cell_labels(records, leave_out=(axis,))
    return along_frame([row for _, rec in records for row in along_rows(rec, labels, axis)], axis)


def along_rows(rec: dict, labels, axis: str) -> list[dict]:
    """One record's `along` row (`labels` named without `axis`); none for a cell that did not run."""
    if rec.get("status") != "ok":
        return []
    s, items = rec.get("summary") or {}, _items(rec)
    held = [i["context_tokens"] for i in items if i.get("context_tokens") is not None]
    firsts = [i["first_token"] for i in items if i.get("first_token")]  # the profiled runs' first-token split
    return [{**_keys(rec, labels), axis: bench_of(rec).get(axis), "cell_id": rec["cell_id"],
             "paired": rec["cell"].get("reference") is not None,
             **{k: s.get(k) for k in ("speedup", "speedup_ci_low", "speedup_ci_high", "tau",
                                      "acceptance_rate", "ttft_ms", "base_ttft_ms")},
             "context_tokens": statistics.mean(held) if held else None,
             **{f"first_{k}_ms": statistics.mean(f.get(k, 0.0) for f in firsts) if firsts else None
                for k in ("prefill", "prepare")},
             **{PHASE_PREFIX + p: ms for p, ms in phase_means(_profiled(items)).items()}}]


def along_frame(rows: list[dict], axis: str) -> pd.DataFrame:
    columns = [c.format(axis=axis) for c in ALONG_COLUMNS]
    df = pd.DataFrame(rows)
    df = df.reindex(columns=columns + [c for c in df.columns if c not in columns])  # the phases follow
    df["block_size"] = df["block_size"].astype("Int64")
    return df


# What a record's values can raise in the builders above when they are damaged in a way its
# field types do not show (a zero rate under a logarithm, reps that do not pair).
DAMAGE = (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, AssertionError)


@dataclass
class Frames:
    """Every frame the report reads, built in one pass over the records, and the records
    left out because their values broke a builder: [(path, why)], named like non-records."""

    records: list
    damaged: list
    cells: pd.DataFrame
    prompts: pd.DataFrame
    profiles: pd.DataFrame
    host: pd.DataFrame
    categories: pd.DataFrame
    depth: pd.DataFrame
    hists: pd.DataFrame
    outside: pd.DataFrame
    along: dict = field(default_factory=dict)  # axis -> `along` frame, for axes with several values


def build_frames(records, width: int = DEPTH_BIN) -> Frames:
    """The Frames of `records`. A record whose values break a builder is left out and named;
    the rest are then built again, since cell names depend on which cells share a table."""
    rows, kept, damaged = _rows_by_record(records, width)
    if damaged:
        rows, kept, more = _rows_by_record(kept, width)
        damaged += more
    return Frames(records=kept, damaged=damaged, cells=cells_frame(rows["cells"]),
                  prompts=pd.DataFrame(rows["prompts"]), profiles=pd.DataFrame(rows["profiles"]),
                  host=pd.DataFrame(rows["host"]), categories=categories_frame(rows["categories"]),
                  depth=depth_frame(rows["depth"]), hists=pd.DataFrame(rows["hists"]),
                  outside=pd.DataFrame(rows["outside"], columns=OUTSIDE_COLUMNS),
                  along={axis: along_frame(rows[axis], axis) for axis in AXES if len(axis_values(kept, axis)) > 1})


def _rows_by_record(records, width: int) -> tuple[dict[str, list], list, list]:
    # Every frame's rows, record by record: (rows by frame, the records kept, [(path, why)] for the others).
    labels, by_depth, *along_labels = cell_label_sets(records, [(), AXES, *((axis,) for axis in AXES)])
    by_axis = dict(zip(AXES, along_labels))
    rows: dict[str, list] = {k: [] for k in ("cells", "prompts", "profiles", "host", "categories", "depth", "hists",
                                             "outside", *AXES)}
    kept, damaged = [], []
    for path, rec in records:
        try:
            got = {"cells": [cell_row(path, rec, labels)], "prompts": prompt_rows(rec, labels),
                   "profiles": profile_rows(rec, labels), "host": profile_rows(rec, labels, "phase_host_ms"),
                   "categories": category_rows(rec, labels), "depth": depth_rows(rec, by_depth, width),
                   "hists": accept_hist_rows(rec, labels), "outside": outside_rows(rec),
                   **{axis: along_rows(rec, by_axis[axis], axis) for axis in AXES}}
        except DAMAGE as e:
            damaged.append((path, f"is a record whose values the report cannot use ({type(e).__name__}: "
                                  f"{_first_line(e)}; damaged or edited by hand)"))
            continue
        kept.append((path, rec))
        for k, v in got.items():
            rows[k] += v
    return rows, kept, damaged


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
