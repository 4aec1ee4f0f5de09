"""Statistics against values computed by hand."""

import math

import pytest

from harness import stats
from harness.measure import Generation, _summary
from harness.loop import Round

# method tok/s 120, 90, 100 and base tok/s 100, 100, 80 over three reps:
# per-rep ratios 1.2, 0.9, 1.25 -> median 1.2; medians 100 / 100 -> ratio of medians 1.0
METHOD, BASE = [120.0, 90.0, 100.0], [100.0, 100.0, 80.0]


def test_paired_summary_matches_hand_computation():
    s = stats.Paired(METHOD, BASE).summary()
    assert s["ratio_reps"] == pytest.approx([1.2, 0.9, 1.25])
    assert s["speedup"] == pytest.approx(1.2)
    assert s["ratio_of_medians"] == pytest.approx(1.0)
    # sigma% of method: mean 103.33, sample sd sqrt((16.67^2 + 13.33^2 + 3.33^2) / 2) = 15.275
    assert s["method_sigma_pct"] == pytest.approx(15.2753 / 103.3333 * 100, rel=1e-4)
    # base: mean 93.33, sd sqrt((6.67^2 * 2 + 13.33^2) / 2) = 11.547
    assert s["reference_sigma_pct"] == pytest.approx(11.5470 / 93.3333 * 100, rel=1e-4)
    # CI: logs 0.18232, -0.10536, 0.22314: mean 0.10003, sd 0.17904, t(2) = 4.303
    half = 4.303 * 0.17904 / math.sqrt(3)
    assert s["speedup_ci_low"] == pytest.approx(math.exp(0.10003 - half), rel=1e-3)
    assert s["speedup_ci_high"] == pytest.approx(math.exp(0.10003 + half), rel=1e-3)
    assert s["speedup_ci_low"] == pytest.approx(0.7085, abs=1e-3)
    assert s["speedup_ci_high"] == pytest.approx(1.7246, abs=1e-3)


def test_one_rep_has_no_interval_and_no_sigma():
    s = stats.Paired([110.0], [100.0]).summary()
    assert s["speedup"] == pytest.approx(1.1)
    assert s["speedup_ci_low"] is None and s["method_sigma_pct"] is None


def test_expected_tokens_and_break_even_acceptance():
    assert stats.expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert stats.expected_tokens(1.0, 4) == 5.0
    assert stats.expected_tokens(0.9, 0) == 1.0
    assert stats.break_even_acceptance(1.5, 1) == pytest.approx(0.5)  # 1 + a = 1.5
    assert stats.break_even_acceptance(2.0, 3) == pytest.approx(0.543689, abs=1e-6)  # a^3 + a^2 + a = 1
    assert stats.break_even_acceptance(0.9, 3) == 0.0  # cheaper than a decode step: always ahead
    assert stats.break_even_acceptance(2.5, 1) is None  # at most 2 tokens per round for 2.5 steps


def test_predicted_speedup_for_a_mixture_of_round_sizes():
    assert stats.RoundMix({3: 10}, {3: 2.0}).predicted_speedup(0.5) == pytest.approx(1.875 / 2.0)
    # n-gram-like: half the rounds draft nothing (cost 1.1), half draft 3 (cost 2.0)
    mix = stats.RoundMix({0: 5, 3: 5}, {0: 1.1, 3: 2.0})
    assert mix.predicted_speedup(0.5) == pytest.approx((5 * 1 + 5 * 1.875) / (5 * 1.1 + 5 * 2.0))
    a = mix.break_even_acceptance()
    assert mix.tokens(a) == pytest.approx(mix.total_cost())


def _gen(tps: float, n_tokens: int = 11) -> Generation:
    # n_tokens - 1 decode tokens at exactly `tps`, in rounds of 2 tokens (1 draft accepted + bonus)
    rounds = [Round(1, 1, [1, 2], 0.0, None) for _ in range((n_tokens - 1) // 2)]
    return Generation([0] * n_tokens, 0.01, (n_tokens - 1) / tps, rounds)


def test_cell_summary_from_generations_matches_hand_computation():
    reps_m = [[_gen(m)] for m in METHOD]
    reps_b = [[_gen(b)] for b in BASE]
    items = [{"n_tokens": 11, "rounds": 5, "drafted": 5, "accepted": 5, "proposed_at": [5], "accepted_at": [5],
              "first_divergence": None, "matched_fraction": 1.0, "deterministic": True}]
    s = _summary(items, reps_m, reps_b)
    assert s["decode_tps_reps"] == pytest.approx(METHOD)
    assert s["base_decode_tps_reps"] == pytest.approx(BASE)
    assert s["speedup"] == pytest.approx(1.2) and s["ratio_of_medians"] == pytest.approx(1.0)
    assert s["speedup_ci_low"] == pytest.approx(0.7085, abs=1e-3)
    assert s["tau"] == pytest.approx(2.0) and s["acceptance_rate"] == 1.0
    assert s["per_position_acceptance"] == [1.0]
