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


def match_start(history: mx.array, length: mx.array, min_n: int, max_n: int) -> mx.array:
    """history [C] ids of which the first `length` ([] int32) are real -> [] int32: the position after
    the latest earlier occurrence of the longest suffix n-gram (min_n..max_n), or -1 without one."""
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
    return start


def lookup(history: mx.array, length: mx.array, k: int, min_n: int, max_n: int) -> mx.array:
    """NgramIndex.propose on the device: history [C] ids of which the first `length` ([] int32) are
    real -> drafts [K]. The longest suffix n-gram that occurred earlier, its latest occurrence, and
    the K tokens after it, copied forward past the end as _copy_forward does. Without a match the
    drafts repeat the last token (a round must have K of them; the verify rejects what is wrong)."""
    return _drafts_from(history, length, match_start(history, length, min_n, max_n), k)


def _drafts_from(history: mx.array, length: mx.array, start: mx.array, k: int) -> mx.array:
    c = history.shape[0]
    period = mx.maximum(length - start, 1)
    drafts = mx.take(history, mx.clip(start + mx.arange(k) % period, 0, c - 1))
    return mx.where(start >= 0, drafts, mx.take(history, mx.maximum(length - 1, 0))).astype(mx.int32)


class NgramStatic(DeviceEngine):
    """N-gram drafting in a round that stays on the device (engines/methods/device.py): the history is a
    device buffer, the lookup (`lookup`) a compiled function of it, made at the end of each round for the
    next one.

    A round verifies K drafts, or none (a one-token step) where the latest outcome read says the lookup
    found no match: as eager n-gram drafting does without a match, so a stretch of text that repeats
    nothing costs base steps, not verifies of K + 1 (on 2 CPU cores a verify of 4 costs ~1.9 steps).
    The outcome read one round late tells whether the round after it matched, so the width of round
    n + 1 follows round n's match (the first two rounds': the prompt's own lookup, read with the prefill):
    a guess that costs, when wrong, a verify of drafts that match nothing or a round without the drafts
    that would have matched; never a token (either round is lossless).
    Under `method.force` every round drafts: a forced count is a count of drafts."""

    name = "ngram"
    knobs = ("block_size", "min_ngram", "max_ngram", "verify")
    fusable = True

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.k, self.block = cfg.block_size - 1, cfg.block_size
        self.wide = True  # the next round queued verifies K drafts (else none)

        def drafts_and_match(h, n):  # -> drafts [K], [] int32 1 where the lookup matched
            start = match_start(h, n, cfg.min_ngram, cfg.max_ngram)
            return _drafts_from(h, n, start, self.k), (start >= 0).astype(mx.int32)

        self._lookup = mx.compile(drafts_and_match)

    def start(self, prompt, max_new_tokens):
        first = super().start(prompt, max_new_tokens)
        # every token a read round can write, and one more round; bucketed, so its shape repeats across prompts
        size = capacity_for(len(prompt) + max_new_tokens + 3 * self.block)
        self.history = mx.concatenate([mx.array(prompt, dtype=mx.int32), first,
                                       mx.zeros((size - len(prompt) - 1,), dtype=mx.int32)])
        self.length = mx.array(len(prompt) + 1, dtype=mx.int32)
        self.drafts, self.matched = self._lookup(self.history, self.length)
        # the first rounds' width from the prompt's own lookup, read with the prefill (which the loop reads
        # for the first token anyway): the first two rounds are queued before any round's outcome is read
        self.wide = self.force is not None or bool(self.matched.item())
        return first

    def round_reach(self) -> int:
        return self.k if self.wide else 0

    def fuse_key(self) -> tuple:
        return (*super().fuse_key(), self.wide)

    def read(self, values: list[int]) -> int:
        reach = super().read(values)
        # the outcome's last entry: did the round after it match; a forced cell drafts every round (its
        # count is of drafts, and the round's cost is what it measures)
        self.wide = bool(values[-1]) or self.force is not None
        return reach

    def round(self):
        drafts = self.drafts if self.wide else self.drafts[:0]  # [K] or [0]
        outcome, _ = self.verify_and_accept(drafts, None)  # [1 + w]: n, then w tokens
        w = outcome.shape[0] - 1
        start = mx.minimum(self.length, self.history.shape[0] - w)  # in bounds, as StaticKVCache writes
        self.history = mx.slice_update(self.history, outcome[1:], start[None], axes=(0,))
        self.length = self.length + outcome[0] + 1
        self.drafts, self.matched = self._lookup(self.history, self.length)
        return mx.concatenate([outcome, self.matched[None]])  # [1 + w + 1]: the match flag last

    def state(self):
        return [*super().state(), self.history, self.length, self.drafts, self.matched]

    def describe(self):
        return {**super().describe(), "k": self.k}
