"""A gate run N times in a row, each bound's worst reading against its bound.

    python jobs/gate_noise.py [--gate ci] [--runs 10] [--out results/gate-noise]

Each run is `python -m harness +gate=<gate> out_dir=<out>/run-NN` (fresh records, nothing
resumed); its table goes to <out>/run-NN.txt. The summary (<out>/summary.md, also printed)
gives per bound the runs that passed, the minimum and maximum reading and the worst run's
margin: how far the worst reading sits from the bound, as a fraction of the bound. A gate
that fails on noise shows here as a bound whose worst margin is near or below zero.
Exit status: 0 when every run passed, 1 when a run's bound fell short, the run's own code when
one failed otherwise (3: a crash, 5: the device stayed held), 2 for bad arguments (--runs 0).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from harness.errors import ConfigError
from harness.faults import guarded, writable_dir


def table_rows(text: str) -> list[list[str]]:
    """The [check, metric, bound, value, verdict] rows of a gate's github-format table."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[-1] in ("pass", "FAIL"):
            rows.append(cells)
    return rows


def margin(bound: str, value: float) -> float:
    """(value - bound) / bound for `>= b`, (bound - value) / bound for `<= b` (0-bounds: the difference)."""
    op, b = bound.split()
    b = float(b)
    d = value - b if op == ">=" else b - value
    return d / abs(b) if b else d


def summarize(runs: list[list[list[str]]]) -> str:
    keys = list(dict.fromkeys((r[0], r[1], r[2]) for rows in runs for r in rows))
    lines = ["| check | metric | bound | runs passed | min | max | worst margin |", "|---|---|---|---|---|---|---|"]
    for check, metric, bound in keys:
        got = [r for rows in runs for r in rows if (r[0], r[1], r[2]) == (check, metric, bound)]
        values = [float(r[3]) for r in got if _number(r[3])]
        passed = sum(r[4] == "pass" for r in got)
        worst = min((margin(bound, v) for v in values), default=float("nan"))
        lo, hi = (f"{min(values):.4g}", f"{max(values):.4g}") if values else ("-", "-")
        lines.append(f"| {check} | {metric} | {bound} | {passed}/{len(runs)} | {lo} | {hi} | {worst:+.1%} |")
    return "\n".join(lines)


def _number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate", default="ci")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--out", default="results/gate-noise")
    args = ap.parse_args(argv)
    if not 1 <= args.runs <= 1000:
        raise ConfigError(f"--runs={args.runs}: a noise study needs 1 to 1000 runs of the gate (e.g. --runs 10)")
    out = writable_dir(args.out, "--out", "pass a writable folder, e.g. --out results/gate-noise")
    runs, codes = [], []
    for i in range(1, args.runs + 1):
        t0 = time.time()
        res = subprocess.run([sys.executable, "-m", "harness", f"+gate={args.gate}", f"out_dir={out}/run-{i:02d}"],
                             capture_output=True, text=True)
        (out / f"run-{i:02d}.txt").write_text(res.stdout + res.stderr)
        runs.append(table_rows(res.stdout))
        codes.append(res.returncode)
        print(f"gate-noise: run {i}/{args.runs} exit {res.returncode} ({time.time() - t0:.0f} s)", file=sys.stderr,
              flush=True)
    text = summarize(runs)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return worst(codes)


def worst(codes: list[int]) -> int:
    """The study's exit code: a run that failed otherwise than by a bound (3, 5, ...) wins over one
    whose bound fell short (1), so a crash is never read as noise."""
    crashed = [c for c in codes if c not in (0, 1)]
    return max(crashed) if crashed else (1 if 1 in codes else 0)


if __name__ == "__main__":
    sys.exit(guarded(lambda: main(sys.argv[1:]), "jobs/gate_noise.py"))
