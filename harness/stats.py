"""Statistics of paired measurements and the speculative speedup model.

Pairing: a cell runs its method arm and its reference (base) arm interleaved,
prompt by prompt, `reps` times. Rep i yields one tok/s per arm over all prompts and
their ratio r_i, measured side by side. The speedup is the median of the r_i; its
confidence interval is a t-interval on log r_i (ratios are multiplicative, so their
logs are the scale on which noise is symmetric), deterministic and reproducible.

Speedup model (Leviathan et al. 2023): with per-token acceptance rate a and K drafts,
a round yields E = (1 - a^(K+1)) / (1 - a) tokens on average. A round costs
c = (draft + verify + accept + rollback) / (one decode step), so the predicted
speedup is tau / c, and the method breaks even where E(a) = c.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Two-sided 95% Student-t quantiles by degrees of freedom (1..30); normal beyond.
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042]


def t975(df: int) -> float:
    return _T975[df - 1] if df <= len(_T975) else 1.960


def sigma_pct(xs: list[float]) -> float | None:
    """Sample standard deviation as a percentage of the mean (None for one value)."""
    if len(xs) < 2:
        return None
    return 100.0 * statistics.stdev(xs) / statistics.mean(xs)


@dataclass
class Paired:
    method: list[float]  # tok/s per rep
    reference: list[float]  # tok/s per rep, same reps

    @property
    def ratios(self) -> list[float]:
        return [m / r for m, r in zip(self.method, self.reference, strict=True)]

    def summary(self) -> dict:
        ratios = self.ratios
        lo, hi = log_t_interval(ratios)
        return {"method_tps_median": statistics.median(self.method),
                "reference_tps_median": statistics.median(self.reference),
                "ratio_reps": ratios, "speedup": statistics.median(ratios),
                "ratio_of_medians": statistics.median(self.method) / statistics.median(self.reference),
                "speedup_ci_low": lo, "speedup_ci_high": hi,
                "method_sigma_pct": sigma_pct(self.method), "reference_sigma_pct": sigma_pct(self.reference)}


def log_t_interval(ratios: list[float]) -> tuple[float | None, float | None]:
    """95% CI of the typical ratio: exp(mean(log r) +- t * sd(log r) / sqrt(n))."""
    if len(ratios) < 2:
        return None, None
    logs = [math.log(r) for r in ratios]
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    mid = statistics.mean(logs)
    return math.exp(mid - half), math.exp(mid + half)


def expected_tokens(a: float, k: int) -> float:
    """Mean tokens per round (accepted drafts + bonus) at acceptance rate a with k drafts."""
    if k == 0:
        return 1.0
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def break_even_acceptance(cost_ratio: float, k: int) -> float | None:
    """Acceptance rate a where expected_tokens(a, k) == cost_ratio, i.e. where the
    method is as fast as base; None if even a = 1 cannot pay for the round."""
    if cost_ratio <= 1.0:
        return 0.0
    if expected_tokens(1.0, k) < cost_ratio:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected_tokens is increasing in a: bisection to ~1e-18
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost_ratio else (lo, mid)
    return (lo + hi) / 2


def predicted_speedup(tau: float, round_ms: float, decode_ms: float) -> float:
    """Tokens per round over the round's cost in decode steps."""
    return tau / (round_ms / decode_ms)
