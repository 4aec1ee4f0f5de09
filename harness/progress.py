"""Sweep progress: cells done / total, elapsed time and a cost-weighted ETA.

Hydra's basic launcher runs the jobs of a multirun one after another in this process,
so module state survives from job to job. The job list is rebuilt the way Hydra's basic
sweeper builds it (the sweep file's `hydra.sweeper.params`, then the command line, as a
Cartesian product), so the ETA can price each remaining job by its method: the mean time
of cells of that method measured so far, else the measured mean scaled by a relative cost
per method (Option C re-prefills every round; base decodes plainly). Jobs that only
repeat an earlier cell (a method that ignores the axis they differ in) cost nothing.
Under other launchers each job is its own process: the prefix then shows the job number.
"""

from __future__ import annotations

import statistics
import sys
import time

# Relative cost of a cell by method (base = 1), from the default sweep's cells on 2 CPU cores
# (2026-11-30, bench=quick: base 5.9 s, ngram 15.1, dflash_a 15.8, eagle3 15.8, mtp 16.6, dflash_c 68.2).
RELATIVE_COST = {"base": 1.0, "mlx_lm": 1.0, "control": 2.0, "ngram": 2.5, "dflash_a": 2.7, "dflash_zlab": 2.7,
                 "eagle3": 2.7, "mtp": 2.8, "dflash_c": 11.5}


class Progress:
    def __init__(self):
        self.start = None
        self.jobs = 0
        self.measured: list[tuple[str, float]] = []  # (method, seconds) of cells measured here

    def begin_job(self) -> str:
        """Count a job and return its '[cell i/N | elapsed | ETA]' prefix."""
        if self.start is None:
            self.start = time.perf_counter()
        self.jobs += 1
        jobs = sweep_jobs()
        index = _job_number() or self.jobs
        elapsed = time.perf_counter() - self.start
        parts = [f"cell {index}/{len(jobs)}" if jobs else f"cell {index}", f"{_dur(elapsed)} elapsed"]
        if jobs and self.measured:
            parts.append(f"ETA {_dur(self.remaining_seconds(jobs[index - 1:]))}")
        return "[" + " | ".join(parts) + "]"

    def measured_cell(self, method: str, seconds: float) -> None:
        self.measured.append((method, seconds))

    def remaining_seconds(self, jobs: list[dict]) -> float:
        """Estimated time of `jobs` (this one included) from the cells measured so far."""
        return sum(self.estimate(job["method"]) for job in jobs if not job["repeat"])

    def estimate(self, method: str) -> float:
        same = [s for m, s in self.measured if m == method]
        if same:
            return statistics.mean(same)
        per_unit = statistics.mean(s / RELATIVE_COST.get(m, 2.0) for m, s in self.measured)
        return per_unit * RELATIVE_COST.get(method, 2.0)


PROGRESS = Progress()


def sweep_jobs() -> list[dict] | None:
    """Every job of the running multirun in launch order, as {"method", "repeat"} (repeat: it
    differs from an earlier job only in an axis its method ignores); None outside one or
    where the command line is not this process's (jobs launched elsewhere)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN or hc.launcher._target_.split(".")[-1] != "BasicLauncher":
            return None
        params = [f"{k}={v}" for k, v in (hc.sweeper.params or {}).items()]
        args = [a for a in sys.argv[1:] if not a.startswith("-") and not a.startswith("hydra")]
        overrides = OverridesParser.create().parse_overrides([*params, *args])
        batch = BasicSweeper.split_arguments(overrides, None)[0]
        return _label_jobs([dict(o.split("=", 1) for o in job) for job in batch], hc.runtime.choices.get("method"))
    except Exception:  # noqa: BLE001 -- progress is cosmetic; never fail a cell over it
        return None


def _label_jobs(jobs: list[dict], default_method: str | None) -> list[dict]:
    from harness.config import knobs_of  # the schema imports Hydra, which this module loads only here

    seen, out = set(), []
    for job in jobs:
        method = _engine_name(job.get("method", default_method))
        knobs = knobs_of(method)
        # the values of the axes this method reads: two jobs equal there are the same cell
        key = (method, tuple(sorted((k, v) for k, v in job.items()
                                    if not k.startswith("method.") or k.split(".", 1)[1] in knobs)))
        out.append({"method": method, "repeat": key in seen})
        seen.add(key)
    return out


def _engine_name(option: str) -> str:
    # A method option names its engine in its YAML (ngram_b8 -> ngram), as the cell does.
    from omegaconf import OmegaConf

    from harness.config import conf_dir  # the schema imports Hydra, which this module loads only here

    path = conf_dir() / "method" / f"{option}.yaml"
    return OmegaConf.load(path).get("name", option) if path.is_file() else option


def _job_number() -> int | None:
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().job.num + 1
    except Exception:  # noqa: BLE001
        return None


def _dur(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
