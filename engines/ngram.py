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

from engines.base import Draft, Engine


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
