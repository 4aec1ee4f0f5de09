"""Speculative sampling math on explicit distributions (no model)."""

import mlx.core as mx

from engines.runtime.sampling import Sampler, accept_deterministic, accept_speculative

P = [0.5, 0.2, 0.15, 0.1, 0.05]  # target
Q = [0.1, 0.1, 0.2, 0.3, 0.3]  # drafter: deliberately unlike the target


def _emitted(n: int, k: int = 1) -> list[float]:
    """Distribution of the first emitted token over n seeded rounds with k drafts from Q."""
    logits = mx.log(mx.array([P] * (k + 1)))  # [k+1, V]: the same p at every position
    q = mx.array([Q] * k)
    counts = [0] * len(P)
    for seed in range(n):
        s = Sampler(1.0, seed)
        tokens = s.draw(q, 0, 1)
        out = accept_speculative(tokens, q, logits, s, 0).tolist()  # [n, emitted...]
        counts[out[1]] += 1  # the first emitted token: the draft if accepted, else the correction
    return [c / n for c in counts]


def test_first_emitted_token_has_the_target_distribution_not_the_drafters():
    got = _emitted(3000)
    tv_p = sum(abs(g - p) for g, p in zip(got, P)) / 2
    tv_q = sum(abs(g - q) for g, q in zip(got, Q)) / 2
    assert tv_p < 0.03, got  # sampling noise at n = 3000 is ~0.015
    assert tv_q > 0.3


def test_acceptance_rate_is_the_overlap_of_p_and_q():
    # P(accept one draft) = sum_x min(p(x), q(x)) = 0.1 + 0.1 + 0.15 + 0.1 + 0.05 = 0.5
    logits = mx.log(mx.array([P, P]))
    q = mx.array([Q])
    n, acc = 2000, 0
    for seed in range(n):
        s = Sampler(1.0, seed)
        acc += accept_speculative(s.draw(q, 0, 1), q, logits, s, 0)[0].item()
    assert abs(acc / n - 0.5) < 0.04


def test_identical_distributions_accept_every_draft():
    logits = mx.log(mx.array([P] * 4))
    q = mx.array([P] * 3)
    for seed in range(50):
        s = Sampler(1.0, seed)
        assert accept_speculative(s.draw(q, 0, 1), q, logits, s, 0)[0].item() == 3


def _outcome(tokens, choices):
    out = accept_deterministic(mx.array(tokens, dtype=mx.int32), mx.array(choices)).tolist()
    return out[0], out[1: out[0] + 2]  # n, emitted


def test_deterministic_acceptance_takes_the_longest_agreeing_prefix():
    assert _outcome([4, 5, 6], [4, 5, 9, 1]) == (2, [4, 5, 9])
    assert _outcome([4, 5], [4, 5, 7]) == (2, [4, 5, 7])
    assert _outcome([], [3]) == (0, [3])
    assert _outcome([8, 5], [4, 5, 7]) == (0, [4])  # agreement after a rejection does not count


def test_speculative_outcome_emits_the_accepted_drafts_then_one_sample():
    logits = mx.log(mx.array([P] * 4))
    q = mx.array([Q] * 3)
    for seed in range(30):
        s = Sampler(1.0, seed)
        tokens = s.draw(q, 0, 1)
        out = accept_speculative(tokens, q, logits, s, 0).tolist()
        n = out[0]
        assert out[1: n + 1] == tokens.tolist()[:n] and 0 <= out[n + 1] < len(P)
