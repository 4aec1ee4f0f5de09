"""Choosing tokens, and the acceptance rules, computed on the device.

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

Both acceptance rules return one small device array, the round's *outcome*:
[n accepted, then K+1 tokens of which the first n+1 are emitted]. The loop reads it
with one host transfer per round; nothing before it waits on the host.
"""

from __future__ import annotations

import mlx.core as mx


class Sampler:
    def __init__(self, temperature: float = 0.0, seed: int = 0):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.temperature, self.seed = temperature, seed

    def _noise(self, pos, n: int, vocab: int) -> mx.array:
        # [n, V] Gumbel noise for output positions pos..pos+n-1, one key per position.
        keys = [self.key(pos + i, 0) for i in range(n)]
        return mx.stack([mx.random.gumbel((vocab,), key=k) for k in keys])

    def key(self, pos, stream: int) -> mx.array:
        """The key of output position `pos` in `stream`; pos an int, or a [] int32 device value
        (a round that stays on the device), which gives the same key without a host read.
        Independent streams per purpose: 0 target choice, 1 drafting, 2 accept test, 3 correction."""
        base = (self.seed << 24) + (stream << 20)
        if not isinstance(pos, mx.array):
            return mx.random.key(base + pos)
        v = mx.array(base, dtype=mx.uint64) + pos.astype(mx.uint64)  # mx.random.key's [high, low] words of it
        return mx.stack([(v >> 32).astype(mx.uint32), (v & 0xFFFFFFFF).astype(mx.uint32)])

    def probs(self, logits: mx.array) -> mx.array:
        """[..., V] logits -> the sampling distribution at this temperature (float32)."""
        return mx.softmax(logits.astype(mx.float32) / self.temperature, axis=-1)

    def draw(self, probs: mx.array, pos: int, stream: int) -> mx.array:
        """Sample one id per row of probs [T, V] for positions pos..pos+T-1."""
        return mx.stack([mx.random.categorical(mx.log(probs[i]), key=self.key(pos + i, stream))
                         for i in range(probs.shape[0])])

    def choose(self, logits: mx.array, pos) -> mx.array:
        """logits [T, V] for output positions pos..pos+T-1 -> the target's ids [T] (pos: an int or a
        device value, as in key)."""
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1)
        scaled = logits.astype(mx.float32) / self.temperature
        return mx.argmax(scaled + self._noise(pos, *logits.shape), axis=-1)

    def propose(self, logits: mx.array, pos: int) -> tuple[mx.array, mx.array | None]:
        """A drafter's pick from its logits [T, V] at positions pos..: (ids [T], q [T, V] or
        None). Greedy drafts are deterministic (q None); sampled ones carry the q they came from."""
        if self.temperature == 0:
            return mx.argmax(logits, axis=-1), None
        q = self.probs(logits)
        return self.draw(q, pos, 1), q


def accept_deterministic(tokens: mx.array, choices: mx.array) -> mx.array:
    """Outcome of a deterministic draft: the longest prefix equal to the target's choices.

    tokens [K] drafts; choices [K+1] the target's token for each position the drafts
    (and the bonus) would fill. A deterministic draft x_i is accepted iff x_i ==
    choice_i: under sampling that is speculative sampling with a one-hot q, so the
    output has the target's distribution; at temperature 0 it is exact greedy
    decoding. The emitted tokens are then choices[:n+1] (accepted drafts equal them).
    """
    k = tokens.shape[0]
    choices = choices.astype(mx.int32)
    if k == 0:
        return mx.concatenate([mx.zeros((1,), dtype=mx.int32), choices])
    n = mx.cumprod((tokens.astype(mx.int32) == choices[:k]).astype(mx.int32)).sum(keepdims=True)  # [1]
    return mx.concatenate([n, choices])


def accept_speculative(tokens: mx.array, q: mx.array, logits: mx.array, sampler: Sampler, pos: int) -> mx.array:
    """Outcome of speculative sampling for drafts tokens [K] sampled from q [K, V]; logits [K+1, V].

    Every candidate for the round's last token is drawn with its own key (the correction
    at each position i < K, the bonus at K) and the one at n is selected on the device,
    so the result equals drawing only the one that is used."""
    k = tokens.shape[0]
    p = sampler.probs(logits)  # [K+1, V]
    x = tokens.astype(mx.int32)
    p_x = mx.take_along_axis(p[:k], x[:, None], axis=-1)[:, 0]  # [K]
    q_x = mx.take_along_axis(q, x[:, None], axis=-1)[:, 0]  # [K]
    u = mx.stack([mx.random.uniform(key=sampler.key(pos + i, 2)) for i in range(k)])
    n = mx.cumprod((u * q_x < p_x).astype(mx.int32)).sum(keepdims=True)  # u < p/q without dividing by a zero q
    residual = mx.maximum(p[:k] - q, 0.0)  # [K, V]
    total = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p[:k])  # p == q there: any sample of p
    last = mx.concatenate([sampler.draw(residual, pos, 3), sampler.draw(p[k:], pos + k, 0)]).astype(mx.int32)
    final = mx.take(last, n)  # [1]
    return mx.concatenate([n, drafts_then(x, final, n)])


def drafts_then(drafts: mx.array, final: mx.array, n: mx.array) -> mx.array:
    """A round's emitted tokens in fixed shape: drafts [K] up to n ([1]), then final [1] from n on -> [K+1]
    (the first n + 1 are what the round emits)."""
    return mx.where(mx.arange(drafts.shape[0] + 1) < n, mx.concatenate([drafts, final]), final)
