"""Statistics of paired measurements and the speculative speedup model.

Pairing: a cell runs its method arm and its reference (base) arm side by side, prompt
by prompt, `reps` times, the order of the two alternating. One estimator throughout:
the geometric mean of paired ratios, with the 95% Student-t interval of the mean of
their logs (ratios are multiplicative, so their logs are the scale on which noise is
symmetric); the estimate always lies inside its own interval. It is applied twice:
- over reps: rep i yields one tok/s per arm over all prompts and their ratio r_i. The
  interval covers timing noise (run-to-run) on this fixed prompt set, nothing more.
- over prompts: each prompt's ratio (geometric mean over its reps) is one sample of
  the prompt population the suite stands for; the interval covers the mean speedup
  over prompts like these (prompt-to-prompt spread), which is what a reader's own
  prompts would see on average.

Speedup model (Leviathan et al. 2023): with per-token acceptance probability alpha
(of a draft, given that those before it were accepted) and K drafts, a round yields
E(alpha, K) = (1 - alpha^(K+1)) / (1 - alpha) tokens on average and costs
c_K = (verify over K+1 tokens + the round's other phases) / (one decode step). Methods
whose drafts vary in length (n-gram proposes nothing without a match) are a mixture
of rounds. The predicted speedup takes the tokens the rounds really yielded:
sum tokens_r / sum c_(K_r). The break-even tau is the mean c; alpha is estimated as
the rate at which sum E(alpha, K_r) equals the measured tokens (acceptance is rarely
independent across positions, and the common accepted/drafted rate is not alpha), and
the break-even alpha is the rate at which sum E(alpha, K_r) = sum c_(K_r).
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


ESTIMATOR = "geometric mean of paired ratios, 95% t-interval on their logs"


@dataclass
class Paired:
    method: list[float]  # tok/s per rep
    reference: list[float]  # tok/s per rep, same reps

    @property
    def ratios(self) -> list[float]:
        return [m / r for m, r in zip(self.method, self.reference, strict=True)]

    def summary(self) -> dict:
        ratios = self.ratios
        point, lo, hi = geo_mean_interval(ratios)
        return {"method_tps_median": statistics.median(self.method),
                "reference_tps_median": statistics.median(self.reference),
                "ratio_reps": ratios, "speedup": point,
                "ratio_of_medians": statistics.median(self.method) / statistics.median(self.reference),
                "speedup_ci_low": lo, "speedup_ci_high": hi,
                "method_sigma_pct": sigma_pct(self.method), "reference_sigma_pct": sigma_pct(self.reference)}


def geo_mean(ratios: list[float]) -> float:
    return math.exp(statistics.mean(math.log(r) for r in ratios))


def geo_mean_interval(ratios: list[float]) -> tuple[float, float | None, float | None]:
    """(geometric mean, its 95% CI low, high): exp(mean(log r) +- t * sd(log r) / sqrt(n));
    no interval from one ratio."""
    lo, hi = log_t_interval(ratios)
    return geo_mean(ratios), lo, hi


def log_t_interval(ratios: list[float]) -> tuple[float | None, float | None]:
    """95% CI of the geometric mean ratio: exp(mean(log r) +- t * sd(log r) / sqrt(n))."""
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


@dataclass
class RoundMix:
    """How many rounds drafted each K, and what a round of each K costs in decode steps."""

    counts: dict[int, int]  # K -> rounds
    cost: dict[int, float]  # K -> c_K

    def tokens(self, a: float) -> float:
        return sum(n * expected_tokens(a, k) for k, n in self.counts.items())

    def total_cost(self) -> float:
        return sum(n * self.cost[k] for k, n in self.counts.items())

    def predicted_speedup(self, a: float) -> float:
        """Speedup if acceptance were independent across positions at rate a."""
        return self.tokens(a) / self.total_cost()

    def speedup_for_tokens(self, tokens: float) -> float:
        """Speedup of these rounds given the tokens they actually yielded."""
        return tokens / self.total_cost()

    def break_even_acceptance(self) -> float | None:
        """Acceptance rate a at which the mixture is exactly as fast as base decoding;
        0 if it is never slower, None if even a = 1 cannot pay for its rounds."""
        return self.iid_acceptance(self.total_cost())

    def iid_acceptance(self, tokens: float) -> float | None:
        """The a at which these rounds would yield `tokens` with independent acceptance
        (0 if fewer than the bonus tokens alone, None if more than a = 1 gives)."""
        if self.tokens(0.0) >= tokens:
            return 0.0
        if self.tokens(1.0) < tokens:
            return None
        lo, hi = 0.0, 1.0
        for _ in range(60):  # tokens(a) increases with a: bisection to ~1e-18
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.tokens(mid) < tokens else (lo, mid)
        return (lo + hi) / 2


def break_even_acceptance(cost_ratio: float, k: int) -> float | None:
    """Acceptance rate a where K=k drafts per round pay for a round costing cost_ratio decode steps."""
    return RoundMix({k: 1}, {k: cost_ratio}).break_even_acceptance()
