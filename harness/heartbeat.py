"""Progress lines from inside long, silent loops (a cell's warm-up, calibration, timed reps)."""

from __future__ import annotations

import time


class Heartbeat:
    """A line every `every_s` from inside loops that otherwise print nothing for as long as the
    user's sizes make them run (a 1,000-token block, a 4,000-token prompt): which phase, how
    far. One per process (progress is cosmetic; it never changes what is measured); silent
    until measure_cell gives it a log. Its cost in a timed loop: one clock read per round."""

    def __init__(self, every_s: float = 30.0):
        self.every_s, self.log, self.phase, self.since, self.last = every_s, None, "", 0.0, 0.0

    def start(self, phase: str) -> None:
        self.phase, self.since = phase, time.perf_counter()
        self.last = self.since

    def beat(self, detail: str = "", *args) -> None:
        # `detail % args` is formatted only when a line is due: beats sit in timed loops.
        if self.log is None:
            return
        now = time.perf_counter()
        if now - self.last >= self.every_s:
            self.last = now
            self.log(f"  ... still in {self.phase}{detail % args}, {now - self.since:.0f}s so far")


HEARTBEAT = Heartbeat()
