"""Choosing target tokens, and the acceptance rule for deterministic drafts.

Temperature 0 is argmax. Temperature > 0 is the Gumbel-max trick with noise keyed
by (seed, output position): every engine that decides output position i draws the
same noise there, so a method whose drafts are deterministic (n-gram) produces
exactly the base sample sequence for the same seed -- the sampled analogue of the
greedy losslessness test.
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
        keys = [mx.random.key((self.seed << 24) + pos + i) for i in range(n)]
        return mx.stack([mx.random.gumbel((vocab,), key=k) for k in keys])

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
