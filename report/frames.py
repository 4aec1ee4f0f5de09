"""Records -> pandas DataFrames. The report reads records only, never live state."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.measure import phase_means
from harness.records import iter_records

CELL_COLUMNS = ["arch", "method", "block_size", "kv", "reference", "status", "base_decode_tps", "decode_tps", "speedup",
                "speedup_ci_low", "speedup_ci_high", "ratio_of_medians", "base_sigma_pct", "decode_sigma_pct",
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
        seen.setdefault(rec["cell"]["arch"]["name"], set()).add((model.get("path"), model_dtype(rec)))
    labels = {}
    for _, rec in records:
        name, model = rec["cell"]["arch"]["name"], rec.get("model", {})
        variants = seen[name]
        parts = []
        if len({p for p, _ in variants}) > 1:
            parts.append(Path(model.get("path") or "?").name)
        if len({d for _, d in variants}) > 1:
            parts.append(model_dtype(rec) or "?")
        labels[rec["cell_id"]] = f"{name} [{', '.join(parts)}]" if parts else name
    return labels


def _keys(rec: dict, labels: dict[str, str]) -> dict:
    # The columns that name a cell in every frame.
    cell = rec["cell"]
    method = cell["method"]["name"]
    if cell.get("reference") not in (None, "base"):
        method += f" vs {cell['reference']}"  # paired against another method, not base
    if cell.get("dispatch"):  # set on the command line: cells that differ only in it must not look alike
        method += " [" + ", ".join(f"{k}={v}" for k, v in sorted(cell["dispatch"].items())) + "]"
    return {"arch": labels[rec["cell_id"]], "method": method,
            "block_size": cell["method"].get("block_size"), "kv": cell["kv"]["name"]}


def cells(root: Path, records=None) -> pd.DataFrame:
    """One row per recorded cell."""
    records = records if records is not None else _records(root)
    labels = arch_labels(records)
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
    labels = arch_labels(records)
    rows = []
    for _, rec in records:
        cell = rec["cell"]
        for item in rec.get("prompts", []):
            row = {**_keys(rec, labels), "cell_id": rec["cell_id"],
                   **{k: v for k, v in item.items() if not isinstance(v, (list, dict))}}
            row.update({f"divergence_{k}": v for k, v in (item.get("divergence") or {}).items()})
            rows.append(row)
    return pd.DataFrame(rows)


def profiles(records) -> pd.DataFrame:
    """Mean ms per round of each phase, one row per cell that was profiled."""
    labels = arch_labels(records)
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
    labels = arch_labels(records)
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
