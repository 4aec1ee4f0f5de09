"""Choosing target tokens, and the acceptance rule for deterministic drafts.

Temperature 0 is argmax. Temperature > 0 is the Gumbel-max trick with noise keyed
by (seed, output position): every engine that decides output position i draws the
same noise there, so a method whose drafts are deterministic (n-gram) produces
exactly the base sample sequence for the same seed -- the sampled analogue of the
greedy losslessness test.

Drafters that sample their drafts from a distribution q use speculative sampling
(Leviathan et al. 2023, Chen et al. 2023): accept draft x_i with probability
min(1, p_i(x_i) / q_i(x_i)); at the first rejection draw the correction from
normalize(max(0, p_i - q_i)); if all K are accepted draw the bonus from p_K. The
output then has exactly the target's distribution p, whatever q is. Random draws
are keyed by (seed, position, stream) so runs are reproducible.
"""

from __future__ import annotations

import mlx.core as mx

from engines.base import Draft


class Sampler:
    def __init__(self, temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature, self.seed = temperature, seed

    def _noise(self, pos: int, n: int, vocab: int) -> mx.array:
        # [n, V] Gumbel noise for output positions pos..pos+n-1, one key per position.
        keys = [self.key(pos + i, 0) for i in range(n)]
        return mx.stack([mx.random.gumbel((vocab,), key=k) for k in keys])

    def key(self, pos: int, stream: int) -> mx.array:
        # Independent streams per purpose: 0 target choice, 1 drafting, 2 accept test, 3 correction.
        return mx.random.key((self.seed << 24) + (stream << 20) + pos)

    def probs(self, logits: mx.array) -> mx.array:
        """[..., V] logits -> the sampling distribution at this temperature (float32)."""
        return mx.softmax(logits.astype(mx.float32) / self.temperature, axis=-1)

    def draw(self, probs: mx.array, pos: int, stream: int) -> mx.array:
        """Sample one id per row of probs [T, V] for positions pos..pos+T-1."""
        return mx.stack([mx.random.categorical(mx.log(probs[i]), key=self.key(pos + i, stream))
                         for i in range(probs.shape[0])])

    def choose(self, logits: mx.array, pos: int) -> mx.array:
        """logits [T, V] for output positions pos..pos+T-1 -> chosen ids [T]."""
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1)
        scaled = logits.astype(mx.float32) / self.temperature
        return mx.argmax(scaled + self._noise(pos, *logits.shape), axis=-1)


def accept_deterministic(draft: Draft, choices: list[int]) -> tuple[int, int]:
    """Longest prefix of the draft equal to the target's choices, plus the bonus.

    choices[i] is the target's token for the position draft.tokens[i] would fill
    (len K+1). A deterministic draft x_i is accepted iff x_i == choice_i: under
    sampling that is speculative sampling with a one-hot q, so the output has the
    target's distribution; at temperature 0 it is exact greedy decoding.
    Returns (n_accepted, bonus token = choices[n_accepted]).
    """
    n = 0
    for x, c in zip(draft.tokens, choices):
        if x != c:
            break
        n += 1
    return n, choices[n]


def accept_speculative(draft: Draft, logits: mx.array, sampler: Sampler, pos: int) -> tuple[int, int]:
    """Speculative sampling for drafts sampled from draft.q [K, V]; logits [K+1, V].

    Returns (n_accepted, next token): the next token is the correction sample at the
    first rejected position, or the bonus sample from p_K when all K are accepted.
    """
    k = len(draft.tokens)
    p = sampler.probs(logits)  # [K+1, V]
    x = mx.array(draft.tokens, dtype=mx.int32)
    p_x = mx.take_along_axis(p[:k], x[:, None], axis=-1)[:, 0]  # [K]
    q_x = mx.take_along_axis(draft.q, x[:, None], axis=-1)[:, 0]  # [K]
    u = mx.stack([mx.random.uniform(key=sampler.key(pos + i, 2)) for i in range(k)])
    accept = (u * q_x < p_x).tolist()  # u < p/q without dividing by a zero q
    n = next((i for i, a in enumerate(accept) if not a), k)
    if n == k:
        return k, sampler.draw(p[k:], pos + k, 0).item()
    residual = mx.maximum(p[n] - draft.q[n], 0.0)
    total = residual.sum()
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[n])  # p == q there: any sample of p
    return n, sampler.draw(residual[None], pos + n, 3).item()
