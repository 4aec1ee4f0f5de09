"""PNG plots for the report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def _label(r) -> str:
    bs = "" if pd.isna(r["block_size"]) else f" b{int(r['block_size'])}"
    return f"{r['arch']} {r['method']}{bs} {r['kv']}"


def speedup_vs_block(df: pd.DataFrame, path: Path) -> Path:
    ok = df[(df["status"] == "ok") & df["block_size"].notna()]
    archs = sorted(df["arch"].unique())
    fig, axes = plt.subplots(1, len(archs), figsize=(5 * len(archs), 4), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        sub = ok[ok["arch"] == arch]
        for (method, kv), g in sub.groupby(["method", "kv"]):
            g = g.sort_values("block_size")
            lo = (g["speedup"] - g["speedup_ci_low"].fillna(g["speedup"])).clip(lower=0)
            hi = (g["speedup_ci_high"].fillna(g["speedup"]) - g["speedup"]).clip(lower=0)
            ax.errorbar(g["block_size"].astype(int), g["speedup"], yerr=[lo, hi], marker="o", capsize=3,
                        label=f"{method} ({kv})")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if len(sub):
            ax.set_xticks(sorted(sub["block_size"].astype(int).unique()))
        ax.set(title=arch, xlabel="block size (K + 1)", ylabel="speedup vs base (paired)")
        if len(sub):
            ax.legend(fontsize=8)
    return _save(fig, path)


def tau_histograms(hists: pd.DataFrame, path: Path) -> Path:
    groups = list(hists.groupby(["arch", "method", "block_size", "kv"], dropna=False)) if len(hists) else []
    n = max(len(groups), 1)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.5 * cols, 2.8 * rows), squeeze=False)
    for ax, ((arch, method, bs, kv), g) in zip(axes.flat, groups):
        frac = g["rounds"] / max(g["rounds"].sum(), 1)
        ax.bar(g["accepted"], frac)
        bs = "" if pd.isna(bs) else f" b{int(bs)}"
        ax.set(title=f"{arch} {method}{bs} {kv}", xlabel="drafts accepted per round", ylabel="share of rounds")
        ax.title.set_fontsize(8)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    if not groups:
        axes[0][0].text(0.5, 0.5, "no drafting cells", ha="center", va="center")
    return _save(fig, path)


def phase_colors(phases: list[str]) -> dict[str, tuple]:
    """One distinct colour per phase (tab20, then evenly spaced hues past 20 phases)."""
    if len(phases) <= 20:  # tab20's strong shades first, then their light pairs: neighbours differ in hue
        cmap = plt.get_cmap("tab20")
        order = [*range(0, 20, 2), *range(1, 20, 2)]
        return {p: cmap(order[i]) for i, p in enumerate(phases)}
    cmap = plt.get_cmap("hsv")
    return {p: cmap(i / len(phases)) for i, p in enumerate(phases)}


def profile_bars(prof: pd.DataFrame, path: Path) -> Path:
    """Per-round phase profile: ms per round (top) and each phase's share of its round
    (bottom), so methods with rounds 100x shorter than Option C's stay legible."""
    fig, (top, shares) = plt.subplots(2, 1, figsize=(max(7, 0.7 * len(prof) + 3), 8), sharex=True)
    if len(prof):
        phases = [c for c in prof.columns if c not in ("arch", "method", "block_size", "kv", "cell_id")]
        colors = phase_colors(phases)
        labels = [_label(r) for _, r in prof.iterrows()]
        totals = prof[phases].fillna(0.0).sum(axis=1).replace(0.0, 1.0)
        bottom_ms, bottom_share = pd.Series(0.0, index=prof.index), pd.Series(0.0, index=prof.index)
        for p in phases:
            vals = prof[p].fillna(0.0)
            top.bar(labels, vals, bottom=bottom_ms, label=p, color=colors[p])
            shares.bar(labels, vals / totals, bottom=bottom_share, color=colors[p])
            bottom_ms += vals
            bottom_share += vals / totals
        top.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        shares.tick_params(axis="x", rotation=60, labelsize=7)
    top.set(ylabel="ms per round (profiled pass)", title="per-round phase profile")
    shares.set(ylabel="share of the round", ylim=(0, 1))
    return _save(fig, path)


def predicted_vs_measured(df: pd.DataFrame, path: Path) -> Path:
    """Predicted against measured speedup, for cells measured against base only: the model predicts
    in base decode steps, so a speedup against mlx-lm or z-lab is not its measured counterpart."""
    ok = df[(df["status"] == "ok") & df["predicted_speedup"].notna() & (df["reference"] == "base")]
    fig, ax = plt.subplots(figsize=(5, 5))
    for method, g in ok.groupby("method"):
        ax.scatter(g["predicted_speedup"].astype(float), g["speedup"].astype(float), label=method)
    values = pd.concat([ok["predicted_speedup"], ok["speedup"]]).astype(float)
    top = max(1.5, values.max() * 1.1) if len(values) else 1.5
    ax.plot([0, top], [0, top], color="grey", lw=0.8, ls="--")
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="predicted speedup (cost model)", ylabel="measured speedup",
           title="speedup model vs measurement")
    if len(ok):
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
