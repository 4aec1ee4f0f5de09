"""rollback=auto picks the strategy fastest for the cell's own acceptance, not a uniform mix.

Synthetic costs (the verify-and-rollback timer replaced): 'capture' is cheap when few drafts
are kept and dear when many are, 'replay' costs the same whatever is kept. Uniformly weighted
replay wins; weighted by a warm-up that rejected every draft, capture does."""

import pytest

from engines.runtime.target import Target
from harness import calibrate

BLOCK = 4


@pytest.fixture
def synthetic_costs(monkeypatch):
    def timed(target, start, tokens, n_keep=None):
        target.rewind(start)
        if target.strategy == "capture":
            return float(1 + 3 * (n_keep - 1))  # 1, 4, 7, 10 ms for keep 1..4
        return 5.0 if target.strategy == "replay" else 100.0

    monkeypatch.setattr(calibrate, "_timed_verify", timed)


def test_uniform_weights_without_a_warm_up(models, synthetic_costs):
    model, tok = models["qwen35"]
    out = calibrate.compare_rollbacks(Target(model), tok.encode("a b c d e f"), BLOCK)
    assert out["weighted_by"] == "uniform" and out["weights"] == [1] * BLOCK
    assert out["verify_and_rollback_ms"]["capture"] == pytest.approx(5.5)
    assert out["fastest"] == "replay"


def test_the_warm_up_acceptance_weights_the_choice(models, synthetic_costs):
    model, tok = models["qwen35"]
    hist = [9, 1, 0, 0]  # rounds by accepted count: nearly every draft rejected, so keep = 1 or 2
    out = calibrate.compare_rollbacks(Target(model), tok.encode("a b c d e f"), BLOCK, hist)
    assert out["weights"] == hist and out["weighted_by"] == "the warm-up's accepted counts"
    assert out["verify_and_rollback_ms"]["capture"] == pytest.approx((9 * 1 + 1 * 4) / 10)
    assert out["fastest"] == "capture"
