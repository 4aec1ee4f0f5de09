"""N-gram (prompt lookup) drafting.

Propose up to K = block_size - 1 tokens by finding the longest suffix n-gram of the
history (min_ngram <= n <= max_ngram) that occurred earlier, taking the most recent
earlier occurrence, and copying the tokens that followed it. A match close to the
end of the history has fewer than K followers: the copy then runs on into the tokens
it has just copied (as an LZ77 back-reference does), which continues a repeating
pattern -- a loop, a list, a table row -- for the full K rather than stopping at
the end. With no match the draft is empty, so the round is a plain decode step.

Lookup is O(max_ngram) per round: an index maps each n-gram to the end position of
its latest occurrence, extended incrementally as the history grows, so per-round
Python cost does not grow with the context.
"""

from __future__ import annotations

import mlx.core as mx

from engines.base import Draft, Engine
from engines.methods.device import DeviceEngine
from engines.runtime.static import capacity_for


class NgramIndex:
    """Latest end position of every n-gram (min_n..max_n) of a growing history.

    The n-gram ending at the newest position is indexed only once a token follows
    it, so a lookup of the current suffix always finds an earlier occurrence.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_end: dict[tuple, int] = {}
        self.indexed = 0  # positions < indexed have had their n-grams recorded

    def extend(self, history: list[int]) -> None:
        for end in range(self.indexed, len(history) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_end[tuple(history[end - n + 1: end + 1])] = end
        self.indexed = max(self.indexed, len(history) - 1)

    def propose(self, history: list[int], k: int) -> list[int]:
        self.extend(history)
        for n in range(min(self.max_n, len(history)), self.min_n - 1, -1):
            end = self.last_end.get(tuple(history[-n:]))
            if end is not None:
                return _copy_forward(history, end + 1, k)
        return []


def _copy_forward(history: list[int], start: int, k: int) -> list[int]:
    # k tokens from history[start:], continuing into the copy itself past the end (start < len(history)).
    out = history[start: start + k]
    period = len(history) - start  # when out is short, it already holds one whole period
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


class Ngram(Engine):
    name = "ngram"
    knobs = ("block_size", "min_ngram", "max_ngram", "verify")

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.k = cfg.block_size - 1
        self.min_n, self.max_n = cfg.min_ngram, cfg.max_ngram

    def prefill(self, prompt):
        self.index = NgramIndex(self.min_n, self.max_n)
        return super().prefill(prompt)

    def draft(self, history):
        return Draft(self.index.propose(history, self.k))


def lookup(history: mx.array, length: mx.array, k: int, min_n: int, max_n: int) -> mx.array:
    """NgramIndex.propose on the device: history [C] ids of which the first `length` ([] int32) are
    real -> drafts [K]. The longest suffix n-gram that occurred earlier, its latest occurrence, and
    the K tokens after it, copied forward past the end as _copy_forward does. Without a match the
    drafts repeat the last token (a round must have K of them; the verify rejects what is wrong)."""
    c = history.shape[0]
    idx = mx.arange(c)
    start = mx.array(-1, dtype=mx.int32)
    for n in range(min_n, max_n + 1):  # ascending: a longer match found later wins
        suffix = mx.take(history, mx.maximum(length - n + mx.arange(n), 0))  # [n]
        ends = (idx >= n - 1) & (idx <= length - 2) & (length >= n)  # n-grams followed by a token
        for j in range(n):  # the n-gram ending at e equals the suffix: history[e - j] == suffix[n - 1 - j]
            shifted = history if j == 0 else mx.concatenate([mx.full((j,), -1, history.dtype), history[: c - j]])
            ends = ends & (shifted == suffix[n - 1 - j])
        latest = mx.max(mx.where(ends, idx, -1))
        start = mx.where(latest >= 0, latest + 1, start)
    period = mx.maximum(length - start, 1)
    drafts = mx.take(history, mx.clip(start + mx.arange(k) % period, 0, c - 1))
    return mx.where(start >= 0, drafts, mx.take(history, mx.maximum(length - 1, 0))).astype(mx.int32)


class NgramStatic(DeviceEngine):
    """N-gram drafting in a round that stays on the device (engines/methods/device.py): the history is a
    device buffer, the lookup (`lookup`) a compiled function of it, the K drafts always K."""

    name = "ngram"
    knobs = ("block_size", "min_ngram", "max_ngram", "verify")
    fusable = True

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.k, self.block = cfg.block_size - 1, cfg.block_size
        self._lookup = mx.compile(lambda h, n: lookup(h, n, self.k, cfg.min_ngram, cfg.max_ngram))

    def start(self, prompt, max_new_tokens):
        first = super().start(prompt, max_new_tokens)
        # every token a read round can write, and one more round; bucketed, so its shape repeats across prompts
        size = capacity_for(len(prompt) + max_new_tokens + 3 * self.block)
        self.history = mx.concatenate([mx.array(prompt, dtype=mx.int32), first,
                                       mx.zeros((size - len(prompt) - 1,), dtype=mx.int32)])
        self.length = mx.array(len(prompt) + 1, dtype=mx.int32)
        return first

    def round(self):
        drafts = self._lookup(self.history, self.length)  # [K]
        outcome, _ = self.verify_and_accept(drafts, None)
        start = mx.minimum(self.length, self.history.shape[0] - (self.k + 1))  # in bounds, as StaticKVCache writes
        self.history = mx.slice_update(self.history, outcome[1:], start[None], axes=(0,))
        self.length = self.length + outcome[0] + 1
        return outcome

    def state(self):
        return [*super().state(), self.history, self.length]

    def describe(self):
        return {**super().describe(), "k": self.k}
