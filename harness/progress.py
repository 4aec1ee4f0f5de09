"""Sweep progress: cells done / total, elapsed time and ETA, across Hydra's jobs.

Hydra's basic launcher runs the jobs of a multirun one after another in this
process, so module state survives from job to job. The total is the product of the
sweep's axes: the sweep file's `hydra.sweeper.params`, overridden by comma lists
given on the command line.
"""

from __future__ import annotations

import math
import sys
import time


class Progress:
    def __init__(self):
        self.start = None
        self.jobs = 0
        self.measured = 0
        self.measured_s = 0.0

    def begin_job(self) -> str:
        """Count a job and return its '[cell i/N | elapsed | ETA]' prefix."""
        if self.start is None:
            self.start = time.perf_counter()
        self.jobs += 1
        total = sweep_size()
        elapsed = time.perf_counter() - self.start
        parts = [f"cell {self.jobs}/{total}" if total else f"cell {self.jobs}", f"{_dur(elapsed)} elapsed"]
        if total and self.measured:
            parts.append(f"ETA {_dur(self.measured_s / self.measured * (total - self.jobs + 1))}")
        return "[" + " | ".join(parts) + "]"

    def measured_cell(self, seconds: float) -> None:
        self.measured += 1
        self.measured_s += seconds


PROGRESS = Progress()


def sweep_size() -> int | None:
    """Number of jobs in the running multirun, or None outside one."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return None
        axes = {k: len(str(v).split(",")) for k, v in (hc.sweeper.params or {}).items()}
        args = [a for a in sys.argv[1:] if not a.startswith("-")]
        for o in OverridesParser.create().parse_overrides(args):
            if o.is_sweep_override():
                axes[o.key_or_group] = len(list(o.sweep_string_iterator()))
        return math.prod(axes.values()) if axes else 1
    except Exception:  # noqa: BLE001 -- progress is cosmetic; never fail a cell over it
        return None


def _dur(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
