"""Markdown tables (tabulate, github format) from the report DataFrames."""

from __future__ import annotations

import pandas as pd
from tabulate import tabulate

from harness.records import LOAD_WARN
from report.frames import ALL, PHASE_PREFIX


def _fmt(x, spec: str) -> str:
    if x is None or (not isinstance(x, (list, tuple)) and pd.isna(x)):
        return "-"
    return format(int(x) if spec == "d" else x, spec)


def _rows(df: pd.DataFrame) -> list[dict]:
    # A frame's rows as plain dicts: what iterrows gives these mixed frames, at a fraction of its cost.
    return df.to_dict("records")


def _md(rows, headers) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _speedup(r, key: str = "speedup") -> str:
    # "1.234x [lo, hi]": an estimate and its own interval (key_ci_low / key_ci_high), "-" where absent
    if r.get(key) is None or pd.isna(r.get(key)):
        return "-"
    s = _fmt(r[key], ".3f") + "x"
    if r.get(f"{key}_ci_low") is not None and not pd.isna(r.get(f"{key}_ci_low")):
        s += f" [{r[f'{key}_ci_low']:.3f}, {r[f'{key}_ci_high']:.3f}]"
    return s


def _pair(r, ref: str, method: str, spec: str) -> str:
    return f"{_fmt(r.get(ref), spec)}/{_fmt(r.get(method), spec)}"


def _one_line(text) -> str:
    # A reason (an exception's message) inside one table cell: no line breaks, no column bars.
    return " ".join(str(text).split()).replace("|", "/")


def _positions(rates) -> str:
    if not isinstance(rates, (list, tuple)) or not rates:
        return "-"
    return " ".join("-" if x is None else f"{x:.2f}" for x in rates)


def _sigma(r) -> str:
    return f"{_fmt(r['base_sigma_pct'], '.1f')}/{_fmt(r['decode_sigma_pct'], '.1f')}"


def _order(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values(["method", "block_size", "kv"], na_position="first")


def _sampled(r) -> bool:
    # a row of a cell sampled at temperature > 0 (frames without the column: greedy)
    t = r.get("temperature")
    return t is not None and not pd.isna(t) and t > 0


def cell_table(df: pd.DataFrame) -> str:
    """method x block size x kv for one arch: paired tok/s and speedup, acceptance, divergence."""
    rows = []
    for r in _rows(_order(df)):
        if r["status"] != "ok":
            rows.append([r["method"], _fmt(r["block_size"], "d"), r["kv"], *["-"] * 10,  # the reason under "diverged"
                         f"{r['status']}: {_one_line(r['reason'])}"])
            continue
        rows.append([r["method"], _fmt(r["block_size"], "d"), r["kv"], _fmt(r["base_decode_tps"], ".1f"),
                     _fmt(r["decode_tps"], ".1f"), _speedup(r), _speedup(r, "speedup_prompts"),
                     _speedup(r, "e2e_speedup"), _pair(r, "base_ttft_ms", "ttft_ms", ".1f"), _fmt(r["tau"], ".2f"),
                     _fmt(r["acceptance_rate"], ".1%"), _positions(r["per_position_acceptance"]),
                     _sigma(r), _diverged(r)])
    headers = ["method", "block", "kv", "reference tok/s", "tok/s", "speedup [95% CI: reps]",
               "over prompts [95% CI]", "end-to-end [95% CI: reps]", "TTFT ms reference/method", "tau", "accept",
               "accept by position", "sigma% reference/method", "diverged"]
    also = sorted(df["also_against"].dropna().unique()) if "also_against" in df else []
    if also:  # a second reference timed in the same reps (also_against): its speedup beside the reference's
        for row, r in zip(rows, _rows(_order(df))):
            row.insert(6, _speedup(r, "also_speedup") if r["status"] == "ok" else "-")
        headers.insert(6, f"vs {'/'.join(also)} [95% CI: reps]")
    return _md(rows, headers)


def _diverged(r) -> str:
    # "1/3 (first at 12)": prompts whose output left the reference's, of all; "-" for a count not recorded.
    n = r["diverged_prompts"]
    div = f"{_fmt(n, 'd')}/{_fmt(r['prompts'], 'd')}"
    if r.get("forced") is True:  # a forced accept emits drafts the target did not choose: no losslessness evidence
        return div + (" (forced: expected)" if not pd.isna(n) and n else " (forced)")
    if pd.isna(n) or not n:
        return div
    if _sampled(r):
        return div + " (sampled: expected)"  # a sampled output leaves the greedy one by design
    return div + f" (first at {_fmt(r['earliest_divergence'], 'd')})"


def _span(xs: pd.Series, spec: str) -> str:
    lo, hi = format(xs.min(), spec), format(xs.max(), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def ceiling_line(df: pd.DataFrame) -> str:
    """Decode's physical bound for this arch and how close base decoding comes to it."""
    ok = df[(df["status"] == "ok") & df["ceiling_tps"].notna()]
    if ok.empty:
        return ""
    number = lambda col: pd.to_numeric(ok[col], errors="coerce")  # noqa: E731 -- None where a record lacks it
    ceiling, gbs = number("ceiling_tps").median(), number("stream_gbs").median()
    # base decoding's tok/s: the base arm of cells paired with base, and base cells paired with anything
    base = pd.concat([ok.loc[ok["reference"] == "base", "base_decode_tps"],
                      ok.loc[ok["method"].str.split().str[0] == "base", "decode_tps"]]).astype(float)
    if base.empty:
        return ""
    share = base / float(ceiling)
    return (f"Weights {number('weight_bytes').iloc[0] / 1e6:.2f} MB. Decode ceiling {ceiling:,.0f} tok/s: every weight "
            f"read once per token at {gbs:.2f} GB/s, the rate of a matrix-vector product of that size here "
            f"(KV reads come on top). Base decoding reaches {_span(share, '.0%')} of it; "
            f"speculation can pass it, since a verify reads the weights once for several tokens.\n\n")


def arch_tables(df: pd.DataFrame) -> str:
    parts = []
    for arch, sub in df.groupby("arch", sort=True):
        kinds = sorted({f"{a} {b}" for a, b in zip(sub["model_type"], sub["dtype"]) if not pd.isna(a)}) or ["?"]
        parts.append(f"### {arch} ({', '.join(kinds)})\n\n{ceiling_line(sub)}{conditions_line(sub)}"
                     f"{cell_table(sub)}\n")
    return "\n".join(parts)


def conditions_line(df: pd.DataFrame) -> str:
    """Warnings about where the cells ran: under background load, or on several hosts."""
    notes = []
    hosts = sorted(h for h in df["host"].dropna().unique()) if "host" in df else []
    if len(hosts) > 1:
        notes.append(f"This table mixes {len(hosts)} hosts ({', '.join(hosts)}): each speedup is paired within "
                     "its own cell and host; compare tok/s across rows only as ratios.")
    loaded = df[pd.to_numeric(df.get("other_cpu_share"), errors="coerce") > LOAD_WARN] \
        if "other_cpu_share" in df else df.iloc[:0]
    if len(loaded):
        worst = loaded["other_cpu_share"].astype(float).max()
        cells = ", ".join(f"{r['method']} b{_fmt(r['block_size'], 'd')} {r['kv']}" for r in _rows(loaded))
        notes.append(f"**Measured under load**: other processes kept up to {worst:.0%} of the CPUs busy during "
                     f"{len(loaded)} cell(s) ({cells}); their tok/s and ratios are less trustworthy.")
    return "".join(f"{n}\n\n" for n in notes)


PROFILE_KEYS = ["arch", "method", "block_size", "kv"]


def _phase_columns(prof: pd.DataFrame) -> list[str]:
    # A profiles() frame's phase columns: every column but the cell's keys.
    return [c for c in prof.columns if c not in PROFILE_KEYS + ["cell_id"]]


def _round_sum(vals) -> float:
    return sum(v for v in vals if not pd.isna(v))


def profile_table(prof: pd.DataFrame) -> str:
    if prof.empty:
        return "_No profiled cells (bench.profile=false)._\n"
    phases = _phase_columns(prof)
    rows = []
    for r in _rows(prof.sort_values(PROFILE_KEYS, na_position="first")):
        vals = [r[p] for p in phases]
        rows.append([r["arch"], r["method"], _fmt(r["block_size"], "d"), r["kv"],
                     *[_fmt(v, ".3f") for v in vals], _fmt(_round_sum(vals), ".3f")])
    return _md(rows, ["arch", "method", "block", "kv"] + [f"{p} ms" for p in phases] + ["round ms"]) + "\n"


HOST_CAPTION = (
    "Each phase's host time before its barrier, against the phase's whole time (host ms / ms, mean per round): "
    "building the phase's lazy graph in Python, and any host read inside it (the accept phase reads the "
    "round's outcome; an EAGLE-3 tree expansion reads its scores once, after its last level). The rest is MLX's evaluation: "
    "on a CPU the arithmetic, on a GPU the kernels and their launches. A phase with no read inside it whose time "
    "is nearly all host is bound by the Python that builds it, whatever the device; a phase that reads inside "
    "counts its waits as host time.")


def host_table(host: pd.DataFrame, prof: pd.DataFrame) -> str:
    # host: profiles(records, "phase_host_ms"); prof: profiles(records), for each phase's whole time.
    whole = {r["cell_id"]: r for r in prof.to_dict("records")}
    phases = _phase_columns(host)
    rows = []
    for r in host.sort_values(PROFILE_KEYS, na_position="first").to_dict("records"):
        total = whole.get(r["cell_id"], {})  # a damaged record may time its host but not its phases
        h, t = _round_sum(r[p] for p in phases), _round_sum(total.get(p) for p in phases)
        rows.append([r["arch"], r["method"], _fmt(r["block_size"], "d"), r["kv"],
                     *[f"{_fmt(r[p], '.2f')} / {_fmt(total.get(p), '.2f')}" for p in phases],
                     f"{h:.2f} / {t:.2f}", _fmt(h / t if t else None, ".0%")])
    return _md(rows, ["arch", "method", "block", "kv"] + phases + ["round", "host share"]) + "\n"


def model_table(df: pd.DataFrame) -> str:
    sub = df[(df["status"] == "ok") & df["verify_cost_ratio"].notna()]
    if sub.empty:
        return "_No drafting cells._\n"
    rows = []
    for r in _rows(_order(sub)):
        rows.append([r["arch"], r["method"], _fmt(r["block_size"], "d"), r["kv"], _fmt(r["acceptance_rate"], ".3f"),
                     _fmt(r["iid_acceptance"], ".3f"), _fmt(r["tau"], ".2f"),
                     _fmt(r["verify_cost_ratio"], ".2f"), _fmt(r["round_cost_ratio"], ".2f"),
                     _fmt(r["predicted_speedup"], ".3f"),
                     _fmt(r["speedup"], ".3f") if r.get("reference", "base") == "base" else f"- (vs {r['reference']})",
                     "never" if pd.isna(r["break_even_acceptance"]) else _fmt(r["break_even_acceptance"], ".1%"),
                     _fmt(r.get("base_pipelining_gain"), ".2f")])
    headers = ["arch", "method", "block", "kv", "acceptance a", "alpha", "tau", "verify cost (x decode)",
               "round cost = break-even tau", "predicted", "measured", "break-even alpha", "base pipelining"]
    return _md(rows, headers) + "\n"


def _control_outcomes(pr: pd.DataFrame) -> dict[tuple, str]:
    # (arch, block, kv, prompt, turn) -> what the control did there: "kept base" or its first index.
    # the label may carry bench settings ("control (T=0.0)"); a sampled control explains nothing
    temperature = pd.to_numeric(pr["temperature"], errors="coerce") if "temperature" in pr else pd.Series(0.0, pr.index)
    ctl = pr[(pr["method"].str.split().str[0] == "control") & ~(temperature > 0)]
    return {(r["arch"], r["block_size"], r["kv"], r["id"], r["turn"]):
            "kept base" if pd.isna(r["first_divergence"]) else f"left at {int(r['first_divergence'])}"
            for r in _rows(ctl)}


def divergence_table(pr: pd.DataFrame) -> str:
    """Each output that left base: where, the base margin there, and -- where the same
    arch, block and kv were also run with method=control -- what the control did; for a
    cell sampled at temperature > 0, that leaving base is expected."""
    if pr.empty or "first_divergence" not in pr or pr["first_divergence"].isna().all():
        return "_No output left the base output._\n"
    control = _control_outcomes(pr)
    sub = pr[pr["first_divergence"].notna()]
    rows = []
    for r in _rows(sub.sort_values(["arch", "method", "block_size", "kv", "id"])):
        key = (r["arch"], r["block_size"], r["kv"], r["id"], r["turn"])
        rows.append([r["arch"], r["method"], _fmt(r["block_size"], "d"), r["kv"], f"{r['id']}/{r['turn']}",
                     int(r["first_divergence"]), _fmt(r["matched_fraction"], ".0%"),
                     _fmt(r.get("divergence_reference_margin"), ".2e"),
                     _fmt(r.get("divergence_method_token_rank"), ".0f"),
                     # sampled: no control can explain a draw, and none is needed
                     "sampled: expected" if _sampled(r) else
                     "-" if r["method"].split()[0] == "control" else control.get(key, "not run")])
    headers = ["arch", "method", "block", "kv", "prompt/turn", "first index", "matched",
               "base top1-top2 margin", "method token rank in base", "control (same block, kv)"]
    return _md(rows, headers) + "\n"


def _mb(x) -> str:
    return "-" if x is None or pd.isna(x) else f"{x / 2**20:,.1f}"


def resources_table(df: pd.DataFrame) -> str:
    """Per cell, each arm's peak device memory, cache bytes at the end of a generation and
    median round time (robust to rare slow rounds), and the reps flagged as outliers."""
    sub = df[df["status"] == "ok"]
    if sub.empty or "peak_memory_bytes" not in sub or sub["peak_memory_bytes"].isna().all():
        return "_No memory measurements in these records._\n"
    rows = []
    for r in _rows(_order(sub)):
        rows.append([r["arch"], r["method"], _fmt(r["block_size"], "d"), r["kv"],
                     f"{_mb(r.get('base_peak_memory_bytes'))} / {_mb(r['peak_memory_bytes'])}",
                     f"{_mb(r.get('base_cache_bytes'))} / {_mb(r['cache_bytes'])}",
                     f"{_fmt(r.get('base_round_ms_median'), '.2f')} / {_fmt(r.get('round_ms_median'), '.2f')}",
                     _fmt(r.get("outlier_reps"), "d")])
    headers = ["arch", "method", "block", "kv", "peak memory MB (reference / method)",
               "cache MB at end (reference / method)", "median round ms (reference / method)", "outlier reps"]
    return _md(rows, headers) + "\n"


CATEGORY_CAPTION = (
    "Each cell's prompts (all their turns) grouped by the suite's categories, computed from the per-prompt "
    "data of the records; `all` is the whole cell, the same numbers as the results table. tok/s per arm: per "
    "rep, the category's decode tokens over its decode time (summed over its prompts), median over reps. "
    "Speedup: per rep, the method's tok/s over the reference arm's tok/s in the same rep (a ratio of summed "
    "tokens over summed time per arm, paired by rep), median over reps; 95% CI a t-interval on the log ratios, "
    "as for the whole cell; `suite <name>` columns, where a cell mixes suites, pool one suite's prompts alike. "
    "tau = decode tokens / rounds; acceptance = accepted / drafted drafts. A category "
    "holds few prompts under a reduced protocol: read its CI before its point estimate.")


def _category_order(cat: pd.DataFrame) -> list[str]:
    return [ALL] + [c for c in dict.fromkeys(cat["category"]) if c != ALL]


def _counts_line(cat: pd.DataFrame, order: list[str]) -> str:
    # prompts/turns per category, a range where the arch's cells ran different subsets
    parts = []
    for c in order:
        sub = cat[cat["category"] == c]
        parts.append(f"{c} {_span(sub['prompts'], 'd')}/{_span(sub['turns'], 'd')}")
    return "Prompts/turns per cell: " + ", ".join(parts) + ".\n\n"


def category_tables(cat: pd.DataFrame) -> str:
    """Per arch, one table per metric (speedup, tok/s, tau, acceptance): a row per cell, a
    column per prompt category (the first, `all`, is the whole cell)."""
    if cat.empty:
        return "_No per-prompt data in these records._\n"
    metrics = [("Speedup vs the reference arm [95% CI]", lambda r: _speedup(r)),
               ("tok/s, reference / method", lambda r: f"{_fmt(r['base_decode_tps'], '.1f')} / "
                                                      f"{_fmt(r['decode_tps'], '.1f')}"),
               ("tau (tokens per verify)", lambda r: _fmt(r["tau"], ".2f")),
               ("Acceptance (accepted / drafted)", lambda r: _fmt(r["acceptance_rate"], ".1%"))]
    parts = []
    for arch, sub in cat.groupby("arch", sort=True):
        order = _category_order(sub)
        by_cell: dict[str, dict] = {}  # cell id -> category -> row (plain dicts: thousands of cells)
        for r in sub.to_dict("records"):
            by_cell.setdefault(r["cell_id"], {})[r["category"]] = r
        cells = sub[sub["category"] == order[0]].sort_values(["method", "block_size", "kv"], na_position="first")
        parts.append(f"### {arch}\n\n{_counts_line(sub, order)}")
        for title, fmt in metrics:
            rows = []
            for c in cells.to_dict("records"):
                g = by_cell[c["cell_id"]]
                rows.append([c["method"], _fmt(c["block_size"], "d"), c["kv"],
                             *[fmt(g[k]) if k in g else "-" for k in order]])
            parts.append(f"{title}:\n\n{_md(rows, ['method', 'block', 'kv', *order])}\n\n")
    return "".join(parts)


def outside_table(df: pd.DataFrame) -> str:
    """Arms implemented outside the harness: implementation, version, launch command, what it could not show."""
    rows = [[f"{r['method']} vs {r['reference']}", r["arm"], _one_line(r["implementation"]), _fmt(r["version"], "s"),
             _one_line(r["launch"]) if r["launch"] else "-", _one_line(r["observed"]) if r["observed"] else "-"]
            for r in _rows(df.drop_duplicates(["method", "reference", "arm", "implementation", "launch"]))]
    return _md(rows, ["cell", "arm", "implementation", "version", "launch", "not observable / how observed"])


def _axis_order(df: pd.DataFrame, *axes: str) -> pd.DataFrame:
    return df.sort_values(["arch", "method", "block_size", "kv", *axes], na_position="first")


def _varying(df: pd.DataFrame, cols) -> list[str]:
    # the axis columns whose values differ between rows: the only ones worth a column
    return [c for c in cols if c in df and df[c].nunique(dropna=False) > 1]


def _first_last(a, b, spec: str) -> str:
    return f"{_fmt(a, spec)} / {_fmt(b, spec)}"


def depth_summary_table(dep: pd.DataFrame) -> str:
    """Per drafting cell, its first and last depth bins side by side (positions, rounds, tau,
    acceptance), with context and temperature columns where those vary. Cells that drafted
    nothing (base decoding, a control) emit one token a round at every depth: left out."""
    drafted = dep.groupby("cell_id")["drafted"].sum() if len(dep) else pd.Series(dtype=float)
    sub = dep[dep["cell_id"].isin(drafted[drafted > 0].index)]
    if sub.empty:
        return "_No drafting cells: no acceptance to read by depth._\n"
    axes = _varying(sub, ["context", "temperature"])
    by_bin = sub.sort_values("bin", kind="stable")  # each cell's first and last bins, without a sort per cell
    firsts = {r["cell_id"]: r for r in by_bin.drop_duplicates("cell_id", keep="first").to_dict("records")}
    lasts = {r["cell_id"]: r for r in by_bin.drop_duplicates("cell_id", keep="last").to_dict("records")}
    bins = sub["cell_id"].value_counts()
    rows = []
    for cid in _axis_order(sub, *axes)["cell_id"].drop_duplicates():
        first, last = firsts[cid], lasts[cid]
        rows.append([first["arch"], first["method"], _fmt(first["block_size"], "d"), first["kv"],
                     *[first[a] for a in axes],
                     f"{first['depth_lo']}-{first['depth_hi']} / {last['depth_lo']}-{last['depth_hi']}",
                     _first_last(first["rounds"], last["rounds"], "d"), _first_last(first["tau"], last["tau"], ".2f"),
                     _first_last(first["acceptance_rate"], last["acceptance_rate"], ".1%"), int(bins[cid])])
    headers = ["arch", "method", "block", "kv", *[{"temperature": "T"}.get(a, a) for a in axes],
               "positions first / last bin", "rounds", "tau", "accept", "bins"]
    return _md(rows, headers) + "\n"


def _phase_costs(df: pd.DataFrame) -> list[str]:
    # The profiled phases, costliest first over the whole table, so each row lists them in one order.
    cols = [c for c in df.columns if c.startswith(PHASE_PREFIX)]
    return sorted(cols, key=lambda c: -df[c].fillna(0.0).sum())


def _phases(r, cols: list[str]) -> str:
    parts = [f"{c[len(PHASE_PREFIX):]} {r[c]:.2f}" for c in cols if not pd.isna(r[c])]
    return ", ".join(parts) if parts else "-"


def context_table(ax: pd.DataFrame) -> str:
    """method x context length (the `along(records, "context")` frame): speedup [95% CI: reps],
    tau, acceptance, TTFT of both arms, the method's profiled first token as the target's prefill
    and its own context pass, and the ms per round of each profiled phase."""
    if ax.empty:
        return "_No cells ran._\n"
    cols = _phase_costs(ax)
    rows = [[r["arch"], r["method"], _fmt(r["block_size"], "d"), r["kv"], _fmt(r["context"], "d"),
             _fmt(r["context_tokens"], ".0f"), _speedup(r), _fmt(r["tau"], ".2f"), _fmt(r["acceptance_rate"], ".1%"),
             _pair(r, "base_ttft_ms", "ttft_ms", ".1f"), _fmt(r["first_prefill_ms"], ".1f"),
             _fmt(r["first_prepare_ms"], ".1f"), _phases(r, cols)]
            for r in _rows(_axis_order(ax, "context"))]
    headers = ["arch", "method", "block", "kv", "context", "context tokens (mean)", "speedup [95% CI: reps]", "tau",
               "accept", "TTFT ms reference/method", "prefill ms", "context pass ms",
               "ms per round by phase (profiled)"]
    return _md(rows, headers) + "\n"


def temperature_table(ax: pd.DataFrame) -> str:
    """method x temperature (the `along(records, "temperature")` frame): speedup [95% CI: reps],
    tau and acceptance; rows at T > 0 say they sampled."""
    if ax.empty:
        return "_No cells ran._\n"
    rows = [[r["arch"], r["method"], _fmt(r["block_size"], "d"), r["kv"],
             "-" if pd.isna(r["temperature"]) else
             f"{float(r['temperature'])}" + (" (sampled)" if _sampled(r) else " (greedy)"),
             _speedup(r), _fmt(r["tau"], ".2f"), _fmt(r["acceptance_rate"], ".1%")]
            for r in _rows(_axis_order(ax, "temperature"))]
    return _md(rows, ["arch", "method", "block", "kv", "T", "speedup [95% CI: reps]", "tau", "accept"]) + "\n"


def forced_table(df: pd.DataFrame) -> str:
    """Forced-acceptance cells (engines/runtime/forced.py), per method in order of tau: the measured speedup
    [95% CI: reps] beside the speedup model's prediction at the same tau, their gap, and the
    break-even tau; then the median gap over all of them."""
    sub = df[(df["status"] == "ok") & df["forced"].astype(bool)]
    if sub.empty:
        return "_No forced cells._\n"
    sub = sub.sort_values(["arch", "method_name", "block_size", "kv", "tau"], kind="stable")
    gaps = (sub["speedup"].astype(float) - sub["predicted_speedup"].astype(float)).abs() / sub["speedup"].astype(float)
    rows = [[r["arch"], r["method_name"], _fmt(r["block_size"], "d"), r["kv"], r["forced_setting"],
             _fmt(r["tau"], ".2f"), _speedup(r), _fmt(r["predicted_speedup"], ".3f"), _fmt(gap, ".1%"),
             _fmt(r["break_even_tau"], ".2f")]
            for r, gap in zip(_rows(sub), gaps)]
    headers = ["arch", "method", "block", "kv", "forced", "tau (measured)", "speedup [95% CI: reps]",
               "predicted at this tau", "gap (of measured)", "break-even tau (model)"]
    known = gaps.dropna()
    tail = (f"\nMedian |measured - predicted| / measured over {len(known)} forced cells: {known.median():.1%} "
            f"(largest {known.max():.1%}, {_rows(sub.loc[[known.idxmax()]])[0]['method_name']} at tau "
            f"{float(sub.loc[known.idxmax(), 'tau']):.2f}).\n" if len(known) else "")
    return _md(rows, headers) + "\n" + tail
