"""Markdown tables (tabulate, github format) from the cell DataFrame."""

from __future__ import annotations

import pandas as pd
from tabulate import tabulate


def _fmt(x, spec: str) -> str:
    return "-" if x is None or pd.isna(x) else format(x, spec)


def cell_table(df: pd.DataFrame) -> str:
    """method x block size x kv for one arch: tok/s, paired speedup, tau, divergence."""
    order = df.sort_values(["method", "block_size", "kv"], na_position="first")
    rows = []
    for _, r in order.iterrows():
        if r["status"] != "ok":
            rows.append([r["method"], _fmt(r["block_size"], "d"), r["kv"], "-", "-", "-", "-", "-",
                         f"{r['status']}: {r['reason']}"])
            continue
        div = f"{int(r['diverged_prompts'])}/{int(r['prompts'])}"
        if r["diverged_prompts"]:
            div += f" (first at {int(r['earliest_divergence'])})"
        rows.append([r["method"], _fmt(r["block_size"], "d"), r["kv"], _fmt(r["base_decode_tps"], ".1f"),
                     _fmt(r["decode_tps"], ".1f"), _fmt(r["speedup"], ".3f") + "x", _fmt(r["tau"], ".2f"),
                     _fmt(r["acceptance_rate"], ".1%"), div])
    headers = ["method", "block", "kv", "base tok/s", "tok/s", "speedup", "tau", "accept", "diverged"]
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def arch_tables(df: pd.DataFrame) -> str:
    parts = []
    for arch, sub in df.groupby("arch", sort=True):
        parts.append(f"### {arch}\n\n{cell_table(sub)}\n")
    return "\n".join(parts)
