"""Performance gates: `python -m harness +gate=<name>` runs a gate file's checks.

A gate file (conf/gate/<name>.yaml) lists checks; each names a cell as overrides and
bounds on metrics of that cell's record summary (`min`: metric >= value, `max`:
metric <= value). Every cell is measured like any other (paired with base, its record
written to out_dir), and always measured: a gate re-runs its cells whatever out_dir holds
(force=true) and judges only records this run made, so a folder of old records cannot pass
it. A gate without checks is refused before it runs (harness/preflight.py). The gate then
prints one table row per bound and returns 1 if any bound is not met or a cell did not run.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from tabulate import tabulate

from harness.errors import ConfigError
from harness.records import LOAD_WARN, read_record
from harness.run import RUN, run_cell


# summary metrics that say whether the output is the target's: a forced cell never passes a bound on them
LOSSLESS_METRICS = ("diverged_prompts", "earliest_divergence", "matched_fraction", "nondeterministic_prompts")


def _cell_config(cfg, check):
    # The command line (minus the gate itself) applies to every check, then the check's own overrides.
    task = [o for o in HydraConfig.get().overrides.task if not o.lstrip("+~").startswith("gate")]
    try:
        return compose(config_name="config", overrides=[*task, *check.overrides, f"out_dir={cfg.out_dir}", "force=true"])
    except Exception as e:  # noqa: BLE001 -- Hydra's errors are multi-line; name the check instead
        raise ConfigError(f"gate check {check.name!r} has bad overrides {list(check.overrides)}: "
                          f"{str(e).splitlines()[0]}") from None


def evaluate(check, record: dict | None, run_id: str | None = None) -> list[list]:
    """Table rows [check, metric, bound, value, verdict] for one check's record; with `run_id`, a
    record another run made fails (it measured nothing now)."""
    if record is None or record.get("status") != "ok":
        why = "no record" if record is None else f"{record['status']}: {record.get('reason')}"
        return [[check.name, "cell", "runs", why, "FAIL"]]
    made_by = (record.get("run") or {}).get("id") if isinstance(record.get("run"), dict) else None
    if run_id is not None and made_by != run_id:
        return [[check.name, "cell", "measured by this run", f"the record was made by run {made_by}", "FAIL"]]
    summary = record["summary"]
    if record.get("forced"):  # a forced cell emits the drafts it was told to keep: no evidence of losslessness
        lossless = [m for m in (*check.min, *check.max) if m in LOSSLESS_METRICS]
        if lossless:
            return [[check.name, m, "a measured acceptance", f"forced acceptance {record['forced']}", "FAIL"]
                    for m in lossless]
    rows = []
    for op, bounds in ((">=", check.min), ("<=", check.max)):
        for metric, bound in bounds.items():
            value = summary.get(metric)
            ok = value is not None and (value >= bound if op == ">=" else value <= bound)
            shown = _missing(metric, summary) if value is None else f"{value:.4g}"
            rows.append([check.name, metric, f"{op} {bound:g}", shown, "pass" if ok else "FAIL"])
    return rows


def _missing(metric: str, summary: dict) -> str:
    """Why a bound's metric has no value in a record: an interval from too few reps (or
    prompts), a cell without a paired base arm, or a name the record does not know."""
    if "ci_" in metric:
        n, what, fix = ((summary.get("speedup_prompts_n") or 0, "prompts (turns)", "bench.max_prompts")
                        if metric.startswith("speedup_prompts") else
                        (len(summary.get("speedup_reps") or []), "paired reps", "bench.reps"))
        if n < 2:
            return f"missing: a 95% CI needs >= 2 {what}, this cell has {n} (raise {fix})"
    if metric not in summary:
        return f"missing: a record's summary has no {metric!r} (a typo in the gate file?)"
    return "missing: the record holds no value for it"


def outliers(record: dict) -> list[str]:
    """One line per flagged rep of a record (either arm): where it ran and how slow it was, so a
    gate that fails on `outlier_reps` says which generation, not only how many."""
    method, reference = record["cell"]["method"]["name"], record["cell"].get("reference") or "base"
    lines = []
    for item in record.get("prompts", []):
        for arm, t in ((method, item), (reference, item.get("base") or {})):
            tps = t.get("decode_tps") or []
            for r in t.get("outlier_reps", []):
                lines.append(f"{item['id']} (turn {item.get('turn', 0)}), {arm} rep {r}: {tps[r]:.1f} tok/s, "
                             f"the arm's median on it {statistics.median(tps):.1f}")
    return lines


def busy_host(record: dict | None) -> float | None:
    """The share of the CPUs other processes kept busy while the record's cell ran, when above
    LOAD_WARN (its speeds then say more about the machine than about the code); else None."""
    share = ((record or {}).get("load") or {}).get("other_cpu_share")
    return share if isinstance(share, (int, float)) and share > LOAD_WARN else None


def run_gate(cfg) -> int:
    """Run every check of cfg.gate; print the table; 0 if all pass, else 1."""
    rows, flagged, busy = [], [], {}
    for i, check in enumerate(cfg.gate.checks, 1):
        print(f"gate {cfg.gate.name}: check {i}/{len(cfg.gate.checks)} {check.name}", file=sys.stderr, flush=True)
        path = run_cell(_cell_config(cfg, check))
        record = read_record(Path(path)) if path else None
        rows += evaluate(check, record, RUN["id"])
        flagged += [f"  {check.name}: {line}" for line in (outliers(record) if record and record.get("status") == "ok" else [])]
        share = busy_host(record)
        if share is not None:
            busy[check.name] = share
    failed = [r for r in rows if r[-1] == "FAIL"]
    if flagged:
        print(f"gate {cfg.gate.name}: reps slower than a third of their arm's median:", *flagged, sep="\n", file=sys.stderr)
    print(tabulate(rows, headers=["check", "metric", "bound", "value", "verdict"], tablefmt="github"))
    if failed:
        print(f"gate {cfg.gate.name}: {len(failed)} of {len(rows)} bounds fell short", file=sys.stderr)
        for name in dict.fromkeys(r[0] for r in failed if r[0] in busy):
            print(f"gate {cfg.gate.name}: {name!r} was measured while other processes kept {busy[name]:.0%} of the "
                  "CPUs busy: its speeds may be the machine's, not the code's (rerun it on a quiet machine)",
                  file=sys.stderr)
        return 1
    print(f"gate {cfg.gate.name}: all {len(rows)} bounds met", file=sys.stderr)
    return 0
