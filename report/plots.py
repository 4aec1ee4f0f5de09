"""PNG plots for the report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.collections import LineCollection

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

# Past this many cells a panel, bar or legend entry per cell is unreadable and costs seconds each
# to draw: the plots switch to one image or one area per series, and name the CSV that holds them.
MANY = 60


def _label(r) -> str:
    bs = "" if pd.isna(r["block_size"]) else f" b{int(r['block_size'])}"
    return f"{r['arch']} {r['method']}{bs} {r['kv']}"


def speedup_vs_block(df: pd.DataFrame, path: Path) -> Path:
    ok = df[(df["status"] == "ok") & df["block_size"].notna()]
    archs = sorted(df["arch"].unique())
    fig, axes = plt.subplots(1, len(archs), figsize=(5 * len(archs), 4), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        sub = ok[ok["arch"] == arch]
        many = _many_lines(ax, sub, ["method", "kv"], "block_size", "speedup", "report.csv")
        for (method, kv), g in sub.groupby(["method", "kv"]) if not many else ():
            g = g.sort_values("block_size")
            lo = (g["speedup"] - g["speedup_ci_low"].fillna(g["speedup"])).clip(lower=0)
            hi = (g["speedup_ci_high"].fillna(g["speedup"]) - g["speedup"]).clip(lower=0)
            ax.errorbar(g["block_size"].astype(int), g["speedup"], yerr=[lo, hi], marker="o", capsize=3,
                        label=f"{method} ({kv})")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if len(sub):
            ax.set_xticks(sorted(sub["block_size"].astype(int).unique()))
        ax.set(title=arch, xlabel="block size (K + 1)", ylabel="speedup vs base (paired)")
        if len(sub) and not many:
            _legend(ax, "report.csv", fontsize=8)
    return _save(fig, path)


def tau_histograms(hists: pd.DataFrame, path: Path) -> Path:
    """Accepted drafts per round, one panel per drafting cell (one image row per cell past MANY)."""
    keys = ["arch", "method", "block_size", "kv"]
    if len(hists) and hists.groupby(keys, dropna=False).ngroups > MANY:
        return _tau_heatmap(hists, keys, path)
    groups = list(hists.groupby(keys, dropna=False)) if len(hists) else []
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


def _tau_heatmap(hists: pd.DataFrame, keys: list[str], path: Path) -> Path:
    # One row per cell, one column per accepted count, the share of its rounds as the colour.
    row = hists.groupby(keys, dropna=False).ngroup().to_numpy()
    col = hists["accepted"].to_numpy(dtype=int)
    width = int(col.max()) + 1
    rounds = np.zeros((row.max() + 1, width))
    np.add.at(rounds, (row, col), hists["rounds"].to_numpy(dtype=float))
    shares = rounds / np.maximum(rounds.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(min(max(6, 0.5 * width + 3), 20), 8))
    image = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, label="share of rounds")
    ax.set(xlabel="drafts accepted per round", ylabel=f"{len(shares)} drafting cells (arch, method, block, kv order)",
           title="accepted drafts per round, one row per cell")
    if width <= 40:  # one tick per count while they fit
        ax.set_xticks(range(width))
    return _save(fig, path)


def _legend(ax, csv: str, **kw) -> None:
    # A legend where it can be read; past MANY entries, a line naming the CSV that tells the lines apart.
    if len(ax.get_legend_handles_labels()[0]) <= MANY:
        ax.legend(**kw)
    else:
        ax.text(0.01, 0.99, f"{len(ax.get_legend_handles_labels()[0])} series: too many to name here ({csv} "
                "has each)", transform=ax.transAxes, va="top", fontsize=8)


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
    if len(prof) > MANY:
        return _profile_areas(prof, path)
    fig, (top, shares) = plt.subplots(2, 1, figsize=(max(7, 0.7 * len(prof) + 3), 8), sharex=True)
    if len(prof):
        phases = [c for c in prof.columns if c not in ("arch", "method", "block_size", "kv", "cell_id")]
        colors = phase_colors(phases)
        labels = [_label(r) for r in prof.to_dict("records")]
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


def _profile_areas(prof: pd.DataFrame, path: Path) -> Path:
    # profile_bars past MANY cells: the same stacks as areas over the cells, one polygon per phase.
    phases = [c for c in prof.columns if c not in ("arch", "method", "block_size", "kv", "cell_id")]
    colors = phase_colors(phases)
    ms = prof[phases].fillna(0.0).to_numpy(dtype=float).T  # [phases, cells]
    totals = ms.sum(axis=0)
    x = np.arange(len(prof))
    fig, (top, shares) = plt.subplots(2, 1, figsize=(14, 8), sharex=True)
    top.stackplot(x, ms, labels=phases, colors=[colors[p] for p in phases], step="mid")
    shares.stackplot(x, ms / np.where(totals == 0, 1.0, totals), colors=[colors[p] for p in phases], step="mid")
    top.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    top.set(ylabel="ms per round (profiled pass)", title=f"per-round phase profile of {len(prof)} cells")
    shares.set(ylabel="share of the round", ylim=(0, 1), xlabel="cells, in profiles.csv order")
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
        _legend(ax, "report.csv", fontsize=8)
    return _save(fig, path)


def speedup_vs_forced_tau(df: pd.DataFrame, path: Path) -> Path:
    """Measured speedup (95% CI over reps as bars) against the tau each forced cell reached, one line
    per method; the speedup model's prediction for the same cells dashed in the same colour."""
    sub = df[(df["status"] == "ok") & df["forced"].astype(bool) & df["speedup"].notna()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = ["arch", "method_name", "block_size", "kv"]
    for _, g in sub.groupby(keys, dropna=False, sort=True):
        g = g.sort_values("tau")
        tau, y = g["tau"].astype(float), g["speedup"].astype(float)
        err = [(y - g["speedup_ci_low"].astype(float)).fillna(0), (g["speedup_ci_high"].astype(float) - y).fillna(0)]
        r = g.iloc[0]
        block = "" if pd.isna(r["block_size"]) else f"block {r['block_size']}, "
        line = ax.errorbar(tau, y, yerr=err, marker="o", ms=4, capsize=2, label=f"{r['method_name']} ({block}{r['arch']})")
        ax.plot(tau, g["predicted_speedup"].astype(float), ls="--", lw=0.9, color=line[0].get_color())
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="tau: tokens per round (forced)", ylabel="speedup vs reference (paired)",
           title="speedup at a forced acceptance (dashed: the speedup model)")
    if len(sub):
        _legend(ax, "report.csv", fontsize=7, loc="upper left")
    return _save(fig, path)


def tau_by_depth(dep: pd.DataFrame, path: Path) -> Path:
    """tau against decode depth (each bin at its first position), one line per drafting cell
    (named with its context and temperature where those vary): where acceptance fades."""
    drafted = dep.groupby("cell_id")["drafted"].sum() if len(dep) else pd.Series(dtype=float)
    sub = dep[dep["cell_id"].isin(drafted[drafted > 0].index)]
    axes = [a for a in ("context", "temperature") if a in sub and sub[a].nunique(dropna=False) > 1]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    many = _many_lines(ax, sub, ["cell_id"], "depth_lo", "tau", "depth.csv")
    for _, g in sub.groupby("cell_id", sort=False) if not many else ():
        g = g.sort_values("bin")
        r = g.iloc[0]
        label = _label(r) + "".join(f" {'T' if a == 'temperature' else a}={r[a]}" for a in axes)
        ax.plot(g["depth_lo"], g["tau"], marker="o", ms=3, label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")  # one token a round: what base decoding yields
    ax.set(xlabel="output position (start of the bin)", ylabel="tau (tokens per round)", title="tau by decode depth")
    if len(sub) and not many:
        _legend(ax, "depth.csv", fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    elif not len(sub):
        ax.text(0.5, 0.5, "no drafting cells", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


NAME = ["arch", "method", "block_size", "kv"]  # the columns that name a line along an axis


def _many_lines(ax, sub: pd.DataFrame, keys: list[str], x: str, y: str, csv: str) -> bool:
    """Past MANY lines (one per `keys`), draw them all as one collection, without markers, bands
    or legend, and say which CSV names them; False (nothing drawn) where they are few enough."""
    if len(sub) == 0 or sub.groupby(keys, dropna=False).ngroups <= MANY:
        return False
    s = sub.sort_values([*keys, x], na_position="first")
    group = s.groupby(keys, dropna=False, sort=False).ngroup().to_numpy()
    cut = np.flatnonzero(np.diff(group)) + 1  # sorted by keys: each line's rows are contiguous
    xs, ys = s[x].astype(float).to_numpy(), s[y].astype(float).to_numpy()
    lines = [np.column_stack(xy) for xy in zip(np.split(xs, cut), np.split(ys, cut))]
    ax.add_collection(LineCollection(lines, colors=plt.rcParams["axes.prop_cycle"].by_key()["color"], lw=0.8,
                                     alpha=0.6))
    ax.autoscale_view()
    ax.text(0.01, 0.99, f"{len(lines)} lines: too many to name here ({csv} has each)", transform=ax.transAxes,
            va="top", fontsize=8)
    return True


def _lines_with_band(ax, sub: pd.DataFrame, x: str, y: str = "speedup") -> bool:
    # One line per cell name (arch, method, block, kv) over `x`, its 95% CI as a band where the records have
    # one; True where they were too many for bands and a legend (`_many_lines`).
    if _many_lines(ax, sub, NAME, x, y, "report.csv"):
        return True
    for _, g in sub.groupby(NAME, dropna=False, sort=True):
        g = g.sort_values(x)
        xs, ys = g[x].astype(float), g[y].astype(float)
        line, = ax.plot(xs, ys, marker="o", ms=4, label=_label(g.iloc[0]))
        lo, hi = g[f"{y}_ci_low"].astype(float), g[f"{y}_ci_high"].astype(float)
        if lo.notna().any():
            ax.fill_between(xs, lo.fillna(ys), hi.fillna(ys), color=line.get_color(), alpha=0.2, lw=0)
    return False


def speedup_vs_context(ax_df: pd.DataFrame, path: Path) -> Path:
    """Speedup against context length, one line per method paired with a reference, the
    95% CI over reps as a band."""
    sub = ax_df[ax_df["paired"].astype(bool) & ax_df["speedup"].notna()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    many = _lines_with_band(ax, sub, "context")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    positive = sub.loc[sub["context"] > 0, "context"]
    if len(positive):  # contexts span decades (0, 512, 8192): linear near 0, logarithmic past the smallest
        ax.set_xscale("symlog", linthresh=float(positive.min()))
        ax.set_xticks(sorted(sub["context"].unique()), [str(int(c)) for c in sorted(sub["context"].unique())])
    ax.set(xlabel="context tokens before each prompt", ylabel="speedup vs reference (paired)",
           title="speedup by context length")
    if len(sub) and not many:
        _legend(ax, "report.csv", fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def speedup_vs_temperature(ax_df: pd.DataFrame, path: Path) -> Path:
    """Speedup (95% CI band) and acceptance against sampling temperature, one line per method."""
    sub = ax_df[ax_df["paired"].astype(bool) & ax_df["speedup"].notna()]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    many = _lines_with_band(left, sub, "temperature")
    many = _many_lines(right, sub, NAME, "temperature", "acceptance_rate", "report.csv") or many
    left.axhline(1.0, color="grey", lw=0.8, ls="--")
    left.set(xlabel="temperature (0 = greedy)", ylabel="speedup vs reference (paired)", title="speedup by temperature")
    for _, g in sub.groupby(NAME, dropna=False, sort=True) if not many else ():
        g = g.sort_values("temperature")
        right.plot(g["temperature"].astype(float), g["acceptance_rate"].astype(float), marker="o", ms=4,
                   label=_label(g.iloc[0]))
    right.set(xlabel="temperature (0 = greedy)", ylabel="acceptance (accepted / drafted)", ylim=(0, 1),
              title="acceptance by temperature")
    if len(sub) and not many:
        _legend(right, "report.csv", fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
