"""Records -> pandas DataFrames. The report reads records only, never live state."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.records import iter_records

CELL_COLUMNS = ["arch", "method", "block_size", "kv", "status", "decode_tps", "base_decode_tps", "speedup",
                "tau", "acceptance_rate", "diverged_prompts", "prompts", "earliest_divergence",
                "matched_fraction", "reason", "model_type", "dtype", "rollback", "backend", "blas_kind",
                "cell_id", "path"]


def cells(root: Path) -> pd.DataFrame:
    """One row per recorded cell."""
    rows = []
    for path, rec in iter_records(root):
        cell, env = rec["cell"], rec.get("env", {})
        row = {"arch": cell["arch"]["name"], "method": cell["method"]["name"],
               "block_size": cell["method"].get("block_size"), "kv": cell["kv"]["name"],
               "status": rec.get("status"), "reason": rec.get("reason"),
               "model_type": rec.get("model", {}).get("model_type"), "dtype": rec.get("model", {}).get("dtype"),
               "rollback": rec.get("engine", {}).get("rollback"), "backend": env.get("backend"),
               "blas_kind": env.get("blas_kind"), "cell_id": rec["cell_id"], "path": str(path)}
        row.update({k: v for k, v in rec.get("summary", {}).items() if not isinstance(v, list)})
        rows.append(row)
    df = pd.DataFrame(rows, columns=None)
    for col in CELL_COLUMNS:
        if col not in df:
            df[col] = None
    df["block_size"] = df["block_size"].astype("Int64")
    return df[CELL_COLUMNS + [c for c in df.columns if c not in CELL_COLUMNS]]


def prompts(root: Path) -> pd.DataFrame:
    """One row per (cell, prompt, turn) of the cells that ran."""
    rows = []
    for _, rec in iter_records(root):
        cell = rec["cell"]
        for item in rec.get("prompts", []):
            rows.append({"arch": cell["arch"]["name"], "method": cell["method"]["name"],
                         "block_size": cell["method"].get("block_size"), "kv": cell["kv"]["name"],
                         "cell_id": rec["cell_id"],
                         **{k: v for k, v in item.items() if not isinstance(v, (list, dict))}})
    return pd.DataFrame(rows)
