"""The ADR-ready markdown document: setup, protocol, results, divergence, profile, model, plots."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pandas as pd

from harness import stats
from harness.errors import ConfigError
from harness.records import scan_records

from report import plots
from report.frames import DEPTH_BIN, Frames, bench_of, build_frames, profiles, sampled
from report.publish import publish, staging
from report.tables import (CATEGORY_CAPTION, HOST_CAPTION, arch_tables, category_tables, context_table,
                           depth_summary_table, divergence_table, forced_table, host_table, model_table,
                           outside_table, profile_table, resources_table, temperature_table)


def _distinct(records, get) -> str:
    values = sorted({str(get(rec)) for _, rec in records})
    return ", ".join(values) if values else "-"


def header(root: Path, records) -> str:
    env = lambda k: _distinct(records, lambda r: r["env"].get(k))
    bench = lambda k: _distinct(records, lambda r: (r["cell"].get("bench") or {}).get(k))
    git = _distinct(records, lambda r: _git(r["env"].get("git") or {}))
    return "\n".join([
        f"# Speculative decoding report: `{root.name}`", "",
        "## Setup", "",
        f"- Hardware: {env('processor')}; device {env('device')} ({env('device_name')}), backend {env('backend')}",
        f"- BLAS: {env('blas_kind')} ({env('blas')}){_blas_selection(records)}",
        *_reference_blas_banner(records),
        f"- Software: mlx {env('mlx')}, mlx-lm {env('mlx_lm')}, Python {env('python')}, {env('platform')}",
        f"- Harness: git {git}; {len(records)} records, "
        f"{_distinct(records, lambda r: (r.get('started_at') or '')[:10])}",
        *_code_lines(records),
        "",
        "## Protocol", "",
        f"- Prompts: suite {bench('suite')}, max_prompts {bench('max_prompts')}, per_category "
        f"{bench('per_category')}, categories {bench('categories')}; {bench('max_new_tokens')} new tokens per generation "
        f"(EOS ignored: {bench('stop_at_eos')} = stop_at_eos), temperature {bench('temperature')}, seed {bench('seed')}",
        *_source_lines(records),
        *_context_lines(records),
        f"- Each method cell runs its method arm and its reference arm side by side on every prompt, "
        f"{bench('reps')} timed reps after {bench('warmup')} warm-up generation(s) per arm, the order of the two "
        f"alternating from rep to rep and prompt to prompt (the records' `arm_order`), the allocator's cache "
        f"emptied before each arm, cool-down {bench('cooldown_s')} s between reps.",
        "- tok/s is decode throughput (tokens after the first / time after the first token). TTFT (time to "
        "first token) is the target's prefill plus the method's own work over the prompt (a drafter's context "
        "pass); end-to-end tok/s counts every token over the whole wait, TTFT included.",
        f"- Every speedup is one estimator: the {stats.ESTIMATOR} (the reference is base decoding unless the "
        "method column names another). `speedup [95% CI: reps]` pairs whole reps (all prompts' tokens over "
        "all their time, per arm): its interval covers run-to-run timing noise on these fixed prompts only. "
        "`over prompts` pairs each prompt (turn) over its reps and takes the same estimator over prompts: its "
        "interval covers prompt-to-prompt spread, i.e. the mean speedup to expect on other prompts like these; "
        "the category tables give both per category. sigma% is the spread of each arm over reps.",
        "- tau = tokens per target verify (accepted drafts + bonus; base = 1). Acceptance = accepted / "
        "drafted tokens; by position: share of drafts at position i that were accepted.",
        *_cut_note(records),
        *_few_reps_note(records),
        "- Profiles come from one extra generation per prompt with an mx.eval barrier after every phase; "
        "they never feed tok/s.",
        "- A reference other than base (`vs mlx_lm`: mlx-lm's generate_step; `vs dflash_zlab`: z-lab's DFlash "
        "reference) is timed the same way in the same cell: the speedup is then against that implementation.",
        "",
    ])


def _code_lines(records) -> list[str]:
    """Which code measured the records (harness/identity.py: the source hash, MLX and mlx-lm), and
    which records ran each where they differ: a table that mixes code versions says so."""
    groups: dict[str, list[str]] = {}
    for _, rec in records:
        groups.setdefault(_code(rec), []).append(rec["cell_id"])
    if len(groups) == 1:
        return [f"- Code: every record ran {next(iter(groups))}"]
    lines = [f"- Code: the records ran {len(groups)} versions of the code; compare their numbers with care:"]
    for code, cells in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(sorted(cells)[:3]) + (f" and {len(cells) - 3} more" if len(cells) > 3 else "")
        lines.append(f"  - {code}: {len(cells)} record(s) ({shown})")
    return lines


def _code(rec: dict) -> str:
    code = (rec.get("inputs") or {}).get("code") if isinstance(rec.get("inputs"), dict) else None
    git = _git(rec["env"].get("git") or {})
    if not isinstance(code, dict):
        return f"git {git} (made before records named their code)"
    return (f"source {str(code.get('source_sha256'))[:12]} (git {git}), mlx {code.get('mlx')}, "
            f"mlx-lm {code.get('mlx_lm')}")


def _git(git: dict) -> str:
    return (git.get("sha") or "?")[:12] + ("+dirty" if git.get("dirty") else "")


def _blas_selection(records) -> str:
    # How harness.blas chose it (records from before the selection existed say so).
    sel = {(r["env"].get("blas_selection") or {}).get("action") or "recorded before harness.blas"
           for _, r in records if r["env"].get("backend") == "cpu"}
    return f"; selection: {', '.join(sorted(sel))}" if sel else ""


def _reference_blas_banner(records) -> list[str]:
    cpu = [r for _, r in records if r["env"].get("backend") == "cpu"]
    ref = [r for r in cpu if r["env"].get("blas_kind") == "reference"]
    if not ref:
        return []
    why = (ref[0]["env"].get("blas_selection") or {}).get("reason") or "recorded before harness.blas"
    return ["", f"> **Reference BLAS.** {len(ref)} of {len(cpu)} CPU records ran on the mlx wheel's reference BLAS "
            f"({ref[0]['env'].get('blas')}), where a float32 forward over 8 tokens costs 6-7 single-token forwards, "
            f"so their speculative speedups understate the methods. Why: {why}. Fix: pip install mkl (or apt-get "
            "install libopenblas0-pthread) and run again.", ""]


def _source_lines(records) -> list[str]:
    # Which files the prompts came from (records since the suite was recorded): package, version, digest.
    seen = {}
    for _, rec in records:
        for s in rec.get("suite") or []:
            pkg = f"{s['distribution']} {s.get('version')}, " if s.get("distribution") else ""
            seen.setdefault(f"`{s.get('spec')}`: {pkg}`{Path(s.get('path') or '?').name}` ({s.get('prompts')} "
                            f"prompts, sha256 {(s.get('sha256') or '?')[:12]})", None)
    return [f"- Prompt files: {'; '.join(seen)}"] if seen else []


def _context_lines(records) -> list[str]:
    # Where cells put earlier conversation before each prompt: how much, and from which file.
    seen = {}
    for _, rec in records:
        c = rec.get("context")
        if c:
            seen.setdefault(f"{c.get('requested')} tokens requested ({c.get('tokens')} held) from "
                            f"`{c.get('source')}` (sha256 {str(c.get('sha256'))[:12]})", None)
    if not seen:
        return []
    return [f"- Context: earlier conversation placed before each prompt, {'; '.join(seen)}; the prompt's own "
            "tokens follow it, and new tokens are counted from there."]


def _cut_note(records) -> list[str]:
    # A reduced protocol (bench=quick, a first run) says what it left out.
    benches = [r["cell"].get("bench") or {} for _, r in records]
    if not any(b.get("per_category") or (b.get("max_new_tokens") or 64) < 64 for b in benches):
        return []
    full = "`bench=real_full`" if any("mtbench" in str(b.get("suite")) for b in benches) else "`bench=full`"
    return ["- **Reduced protocol** (a first run): the first prompts of each category instead of "
            "all of them, or fewer new tokens than the full 64, so acceptance and speedups rest on fewer rounds; "
            f"{full} runs the full protocol."]


def _few_reps_note(records) -> list[str]:
    # Two reps give the reps interval one degree of freedom (t = 12.71): it spans orders of magnitude.
    cells = sorted({r["cell_id"] for _, r in records if len((r.get("summary") or {}).get("speedup_reps") or []) == 2})
    if not cells:
        return []
    return [f"- **Two reps** in {len(cells)} cell(s): their `speedup [95% CI: reps]` rests on one degree of "
            f"freedom (t = {stats.t975(1):.2f}), so it spans orders of magnitude and bounds nothing; read "
            "`over prompts` for them, or rerun with bench.reps >= 3 for a reps interval."]


def unread_section(root: Path, unread: list) -> list[str]:
    # A cell missing from the tables must say why, here as on the terminal.
    if not unread:
        return []
    return ["## Files not read", "", "These files under the results directory are not in any table:", "",
            *[f"- `{p.relative_to(root)}` {why}" for p, why in unread], ""]


class Written(NamedTuple):
    md: Path  # report.md, in place
    cells: pd.DataFrame  # one row per reported cell
    damaged: list  # [(path, why)]: records whose values the report could not use, left out and named


def write(root: Path, scanned: tuple[list, list] | None = None, frames: Frames | None = None) -> Written:
    """Write report.md, CSVs and PNGs into `root`, all or none: they are made in a hidden
    staging folder and moved in together only when all are ready (report/publish.py), so a
    failure leaves the previous report whole (never new CSVs beside a stale report.md).
    `scanned`: scan_records(root), and `frames`: build_frames of its records, where the caller
    has them. ConfigError where no record is left to report or `root` cannot take the report."""
    records, unread = scanned if scanned is not None else scan_records(root)
    frames = frames if frames is not None else build_frames(records)
    if not frames.records:
        raise ConfigError(f"no harness records under {root} that the report can use; run `python -m harness "
                          f"out_dir={root}` first")
    with staging(root) as folder:
        _write_into(root, folder, frames, unread + frames.damaged)
        publish(folder, root)
    return Written(root / "report.md", frames.cells, frames.damaged)


OUTSIDE_CAPTION = ("Arms whose generation loop is not the harness's: reference implementations, engine processes "
                   "(subprocess protocol) and servers. They are timed on the same prompts the same way; what each "
                   "cannot show (logits, per-round acceptance, its own token ids) is named here and left `-` in "
                   "the tables above.")
DIVERGENCE_CAPTION = ("Where an output leaves the reference arm's output: the reference's own top-1/top-2 score margin at "
                      "that position (a margin at float-noise level is a numerical near-tie, a wide one a bug) and the rank "
                      "of the method's token among its scores. The scores are the reference's own: the harness's base "
                      "target re-run over the base output, mlx-lm's log-probabilities for `vs mlx_lm`; an arm that gives "
                      "none (`vs dflash_zlab`) shows `-`. The last column shows what `method=control` (an "
                      "empty draft through the same batched verify) did on that prompt at the same block size and kv, "
                      "when the run includes it: a control that leaves base too means verify numerics, one that keeps "
                      "base points at the method.")
RESOURCES_CAPTION = ("Peak device memory of each arm (reset before each of its generations; the weights are included), "
                     "the bytes its caches hold at the end of a generation (allocated K/V buffers, quantized parts, "
                     "recurrent states; drafter caches included), and the median time of one round (one token for "
                     "base decoding), which rare slow rounds do not move. A rep slower than a third of its arm's median "
                     "on the same prompt is counted as an outlier, never silently averaged.")
MODEL_CAPTION = ("Round cost c = (verify over K+1 tokens + the method's other phases of a round) / one base decode "
                 "step: the verify cost ratio comes from a calibration on the cell's first prompt, the other phases "
                 "from profiled runs of both arms side by side, and the base step is the timed base arm's median "
                 "step (pipelined as it runs; a drafting round reads the host once anyway, so its profile is its "
                 "cost). Predicted = tau / c, the speedup "
                 "the component costs explain for the tokens the rounds yielded; far from measured means a cost the "
                 "profile misses. The method wins when tau > c (the break-even tau). Acceptance a is accepted / "
                 "drafted tokens. alpha is Leviathan et al.'s per-token acceptance: the rate at which independent "
                 "acceptance, E(alpha) = (1 - alpha^(K+1)) / (1 - alpha) tokens per round, yields the measured tau "
                 "(above a, which counts drafts after the first rejection as rejected). Break-even alpha: where "
                 "E(alpha) = c. Base pipelining: the profiled base step (unpipelined, with barriers) over the timed "
                 "base arm's median step, which queues each step before reading the last: what pipelining saves "
                 "base decoding.")


def _write_into(root: Path, out: Path, f: Frames, unread: list) -> None:
    """Every report file for the frames `f`, written into `out`; `unread`: the files left out."""
    records = f.records
    for frame, name in ((f.cells, "report"), (f.categories, "categories"), (f.prompts, "prompts"),
                        (f.profiles, "profiles"), (f.depth, "depth")):
        if name != "depth" or len(f.depth):
            frame.to_csv(out / f"{name}.csv", index=False)
    pngs = [plots.speedup_vs_block(f.cells, out / "speedup_vs_block.png"),
            plots.tau_histograms(f.hists, out / "tau_histograms.png"),
            plots.profile_bars(f.profiles, out / "profile.png"),
            plots.predicted_vs_measured(f.cells, out / "predicted_vs_measured.png")]
    doc = [header(root, records),
           "## Results", "", arch_tables(f.cells),
           "## Results by prompt category", "", CATEGORY_CAPTION, "", category_tables(f.categories),
           *axes_section(f, out),
           *(["## Outside implementations", "", OUTSIDE_CAPTION, "", outside_table(f.outside), ""]
             if len(f.outside) else []),
           "## Divergence from the reference", "", DIVERGENCE_CAPTION + _sampled_note(records), "",
           divergence_table(f.prompts),
           "## Memory and round cost", "", RESOURCES_CAPTION, "", resources_table(f.cells),
           "## Per-round profile (mean ms per round)", "", profile_table(f.profiles),
           *host_section(records, f.profiles, f.host),
           "## Speedup model", "", MODEL_CAPTION, "", model_table(f.cells),
           *forced_section(f.cells, out),
           "## Plots", "", *[f"![{p.stem}]({p.name})" for p in pngs], "",
           *unread_section(root, unread)]
    (out / "report.md").write_text("\n".join(doc))


FORCED_CAPTION = (
    "Cells run with forced acceptance (method.force: each round keeps the chosen number of drafts, or each "
    "position with the chosen probability, and does all its real work): the measured speedup at the tau the "
    "forcing produced, beside what the speedup model predicts for that tau from the cell's own calibrated "
    "round cost. Where they part, the model misses a cost that grows with the accepted length (a longer "
    "commit, a rollback, a catch-up); the break-even tau is where the round cost equals the tokens it yields. "
    "Their outputs are not the target's: divergence is expected there.")


def forced_section(cells: pd.DataFrame, out: Path) -> list[str]:
    """The forced-acceptance table and its plot, where any cell was forced."""
    if "forced" not in cells or not cells["forced"].astype(bool).any():
        return []
    png = plots.speedup_vs_forced_tau(cells, out / "speedup_vs_forced_tau.png")
    return ["### Cost at a chosen acceptance", "", FORCED_CAPTION, "", forced_table(cells),
            f"![{png.stem}]({png.name})", ""]


def host_section(records, prof: pd.DataFrame, host: pd.DataFrame | None = None) -> list[str]:
    # Host time before each phase's barrier, for cells whose records hold it (`host`: their profiles).
    host = profiles(records, "phase_host_ms") if host is None else host
    if host.empty:
        return []
    return ["### Host time before each barrier", "", HOST_CAPTION, "", host_table(host, prof)]


DEPTH_CAPTION = (
    "Each round counted in the bin of {width} output positions that holds its first emitted token (position 0 is "
    "the prefill's token), pooled over a cell's prompts and turns; tau = tokens emitted per round in the bin, "
    "acceptance = accepted / drafted drafts in it. A later bin pools fewer prompts (those that ran that far): "
    "read its rounds before its tau. Cells that draft nothing yield one token a round at every depth and are "
    "left out. Every bin of every cell: depth.csv.")

CONTEXT_CAPTION = (
    "The same cells at each context length (bench.context: tokens of earlier conversation placed before "
    "every prompt; `context tokens` is what the prompts held). Speedup is paired within each cell, so each "
    "row compares the method with its reference at that context. The phases are the profiled run's mean ms "
    "per round, costliest first: a cost that grows with the context (a verify's attention, a drafter's "
    "steps over a longer cache) shows there. `prefill ms` and `context pass ms` split the method's profiled "
    "first token into the target's prefill and the method's own pass over the whole prompt (prepare: an "
    "EAGLE-3, DFlash or MTP drafter reading every prompt position, a draft model's prefill). With "
    "bench.context_reuse (the default) the target's prefill restores the context and feeds only the rest, "
    "so TTFT and `prefill ms` exclude the context's own prefill; the context pass does not.")

TEMPERATURE_CAPTION = (
    "The same cells at each sampling temperature (0 = greedy). At T > 0 both arms sample and drafts are "
    "accepted by the rejection rule, so acceptance falls as the distributions flatten; the outputs leave the "
    "greedy output by design, which is not a defect (the distribution tests check those methods).")


def axes_section(f: Frames, out: Path) -> list[str]:
    """The report along the axes users ask about, each table with its plot written into `out`:
    acceptance by decode depth (whenever cells ran rounds), speedup by context length and by
    temperature (only where the cells ran more than one value: `f.along`)."""
    parts, dep = [], f.depth
    if len(dep):
        png = plots.tau_by_depth(dep, out / "tau_by_depth.png")
        parts += ["### Acceptance by decode depth", "", DEPTH_CAPTION.format(width=DEPTH_BIN), "",
                  depth_summary_table(dep), f"![{png.stem}]({png.name})", ""]
    for axis, title, caption, table, plot in (
            ("context", "Context length", CONTEXT_CAPTION, context_table, plots.speedup_vs_context),
            ("temperature", "Temperature", TEMPERATURE_CAPTION, temperature_table, plots.speedup_vs_temperature)):
        if axis in f.along:
            frame = f.along[axis]
            png = plot(frame, out / f"speedup_vs_{axis}.png")
            parts += [f"### {title}", "", caption, "", table(frame), f"![{png.stem}]({png.name})", ""]
    return ["## Axes", "", *parts] if parts else []


def _sampled_note(records) -> str:
    """A sentence for runs with cells sampled at temperature > 0, whose outputs leave the
    greedy output by design: there a divergence and its margin measure nothing wrong."""
    names = sorted({r["cell"]["method"]["name"] for _, r in records if sampled(bench_of(r))})
    if not names:
        return ""
    return (f" Cells sampled at temperature > 0 ({', '.join(names)}) leave the greedy output by design: "
            "their divergences and margins say nothing about a bug; the distribution tests check those methods.")
