"""Statistics against values computed by hand."""

import math

import pytest

from harness import stats
from harness.summary import cell_summary, speedup_model

# method tok/s 120, 90, 100 and base tok/s 100, 100, 80 over three reps:
# per-rep ratios 1.2, 0.9, 1.25 -> geometric mean exp(mean(log r)) = exp(0.10003) = 1.10521;
# medians 100 / 100 -> ratio of medians 1.0 (a diagnostic, not the estimate)
METHOD, BASE = [120.0, 90.0, 100.0], [100.0, 100.0, 80.0]


def test_paired_summary_matches_hand_computation():
    s = stats.Paired(METHOD, BASE).summary()
    assert s["ratio_reps"] == pytest.approx([1.2, 0.9, 1.25])
    assert s["speedup"] == pytest.approx(1.10521, rel=1e-4)
    assert s["speedup_ci_low"] < s["speedup"] < s["speedup_ci_high"]  # the estimate sits inside its own interval
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
    assert mix.speedup_for_tokens(13.0) == pytest.approx(13.0 / 15.5)
    alpha = mix.iid_acceptance(13.0)  # 5 + 5 * E(alpha, 3) = 13
    assert 1 + alpha + alpha ** 2 + alpha ** 3 == pytest.approx(1.6)
    assert mix.iid_acceptance(4.0) == 0.0 and mix.iid_acceptance(30.0) is None


# A profiled cell by hand: four rounds drafting 3, 3, 0, 3 and accepting 3, 1, 0, 0
# (8 tokens with the bonuses); 0.5 ms of non-verify phases per round; calibrated verify
# 1.0 ms for one token, 1.5 ms for four; a profiled base step of 2.0 ms, 1.8 of it verify.
ROUNDS = {"drafted": [3, 3, 0, 3], "accepted": [3, 1, 0, 0],
          "phase_ms": {"draft": [0.4, 0.4, 0.0, 0.4], "verify": [9.0] * 4, "accept": [0.1] * 4,
                       "rollback": [0.1] * 4}}
CALIBRATION = {"decode_ms": 1.0, "verify_ms_by_tokens": {"1": 1.0, "2": 1.2, "3": 1.4, "4": 1.5},
               "verify_cost_ratio": 1.5}
BASE_PROFILE = {"rounds_detail": {"drafted": [0] * 10, "accepted": [0] * 10,
                                  "phase_ms": {"draft": [0.0] * 10, "verify": [1.8] * 10, "accept": [0.1] * 10,
                                               "rollback": [0.1] * 10}}}


def test_speedup_model_of_a_profiled_cell_matches_hand_computation():
    items = [{"rounds_detail": ROUNDS, "base_profile": BASE_PROFILE}]
    m = speedup_model(items, {"acceptance_rate": 4 / 9}, CALIBRATION, block=4)
    # K=3: (1.5 * 1.8 + 0.5) / 2.0 = 1.6 steps; K=0: (1.0 * 1.8 + 0.5) / 2.0 = 1.15
    assert m["unit"] == "base profile" and m["unit_ms"] == pytest.approx(2.0)
    assert m["overhead_ms"] == pytest.approx(0.5)
    assert m["break_even_tau"] == pytest.approx((3 * 1.6 + 1.15) / 4)
    assert m["profiled_tau"] == pytest.approx(2.0)
    assert m["predicted_speedup"] == pytest.approx(8 / 5.95)
    alpha = m["iid_acceptance"]  # 1 + 3 * E(alpha, 3) = 8 tokens
    assert 1 + alpha + alpha ** 2 + alpha ** 3 == pytest.approx(7 / 3)
    be = m["break_even_acceptance"]  # 1 + 3 * E(be, 3) = 5.95 steps
    assert 1 + be + be ** 2 + be ** 3 == pytest.approx(4.95 / 3)


def test_speedup_model_without_base_profile_or_with_a_re_prefilling_verify():
    m = speedup_model([{"rounds_detail": ROUNDS}], {"acceptance_rate": 0.5}, CALIBRATION, block=4)
    # unit: the calibrated one-token verify (1.0 ms); K=3: 1.5 + 0.5 = 2.0, K=0: 1.0 + 0.5 = 1.5
    assert m["unit"] == "calibration" and m["predicted_speedup"] == pytest.approx(8 / 7.5)
    items = [{"rounds_detail": ROUNDS, "base_profile": BASE_PROFILE}]
    m = speedup_model(items, {"acceptance_rate": 0.5}, CALIBRATION, block=4, incremental=False)
    # every round pays its profiled verify: (9.0 + 0.5) / 2.0 = 4.75 steps
    assert m["break_even_tau"] == pytest.approx(4.75) and m["break_even_acceptance"] is None
    tree = {"drafted": [2, 2], "accepted": [1, 0], "tree_size": [3, 3],
            "phase_ms": {"draft": [0.3, 0.3], "verify": [9.0, 9.0], "accept": [0.1, 0.1], "rollback": [0.1, 0.1]}}
    m = speedup_model([{"rounds_detail": tree, "base_profile": BASE_PROFILE}], {"acceptance_rate": 0.25},
                      CALIBRATION, block=4)
    # a depth-2 tree of 3 nodes feeds 4 tokens: (1.5 * 1.8 + 0.5) / 2.0 = 1.6 steps, not a 3-token verify's
    assert m["break_even_tau"] == pytest.approx(1.6) and m["predicted_speedup"] == pytest.approx(3 / 3.2)
    m = speedup_model(items, {"acceptance_rate": 0.5}, CALIBRATION, block=4, full_block=True)
    # the control's rounds all verify 4 tokens: (1.5 * 1.8 + 0.5) / 2.0 = 1.6 steps each
    assert m["break_even_tau"] == pytest.approx(1.6) and m["predicted_speedup"] == pytest.approx(8 / 6.4)


def _tally(tps: float, n_tokens: int = 11) -> dict:
    # one generation's Generation.tally(): n_tokens - 1 decode tokens at exactly `tps`
    return {"tokens": n_tokens, "decode_tokens": n_tokens - 1, "prefill_s": 0.01, "decode_s": (n_tokens - 1) / tps}


def test_cell_summary_from_rep_tallies_matches_hand_computation():
    reps_m = [[_tally(m)] for m in METHOD]
    reps_b = [[_tally(b)] for b in BASE]
    timing = {"outlier_reps": [], "peak_memory_bytes": 3, "cache_bytes": 2, "round_ms_median": 1.5}
    items = [{"n_tokens": 11, "rounds": 5, "drafted": 5, "accepted": 5, "proposed_at": [5], "accepted_at": [5],
              "first_divergence": None, "matched_fraction": 1.0, "deterministic": True, **timing,
              "decode_tps": METHOD, "base": {**timing, "outlier_reps": [1], "peak_memory_bytes": 4, "decode_tps": BASE}}]
    s = cell_summary(items, reps_m, reps_b)
    assert s["decode_tps_reps"] == pytest.approx(METHOD)
    assert s["base_decode_tps_reps"] == pytest.approx(BASE)
    assert s["speedup"] == pytest.approx(1.10521, rel=1e-4) and s["ratio_of_medians"] == pytest.approx(1.0)
    assert s["speedup_ci_low"] == pytest.approx(0.7085, abs=1e-3)
    # one prompt: its own paired ratio over the reps, and no interval over prompts from one
    assert s["speedup_prompts"] == pytest.approx(1.10521, rel=1e-4) and s["speedup_prompts_ci_low"] is None
    assert s["tau"] == pytest.approx(2.0) and s["acceptance_rate"] == 1.0
    assert s["per_position_acceptance"] == [1.0]
    assert s["outlier_reps"] == 1 and s["peak_memory_bytes"] == 3 and s["base_peak_memory_bytes"] == 4


def test_eta_prices_remaining_cells_by_method_and_skips_repeats():
    from harness.progress import RELATIVE_COST, Progress

    p = Progress()
    p.measured_cell("base", 5.0)
    jobs = [{"method": "base", "repeat": True}, {"method": "ngram", "repeat": False},
            {"method": "dflash_c", "repeat": False}]
    assert p.remaining_seconds(jobs) == pytest.approx(5.0 * (RELATIVE_COST["ngram"] + RELATIVE_COST["dflash_c"]))
    p.measured_cell("dflash_c", 100.0)  # a measured method is priced by its own cells from then on
    assert p.estimate("dflash_c") == 100.0
    assert p.estimate("mtp") == pytest.approx((5.0 + 100.0 / RELATIVE_COST["dflash_c"]) / 2 * RELATIVE_COST["mtp"])


def test_sweep_jobs_mark_cells_that_repeat_an_earlier_one():
    from harness.progress import _label_jobs

    jobs = [{"method": m, "method.block_size": b, "kv": "native"} for m in ("base", "ngram") for b in ("3", "5")]
    assert [j["repeat"] for j in _label_jobs(jobs, "base")] == [False, True, False, False]


def test_a_method_option_counts_as_the_engine_its_yaml_names():
    from harness.progress import _label_jobs

    jobs = [{"method": "ngram"}, {"method": "ngram_b8"}, {"method": "control_b8"}, {"method": "base"}]
    assert [j["method"] for j in _label_jobs(jobs, "base")] == ["ngram", "ngram", "control", "base"]
