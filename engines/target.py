"""The target model and its cache: the one place that runs target forwards.

Every engine prefills, verifies and rolls back through a Target, so cache handling
and exact rollback exist once.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engines.cache import Rollback, make_cache

PREFILL_CHUNK = 2048


class Target:
    """A loaded mlx-lm model plus one sequence's cache.

    State after each call: `offset` tokens are in the cache. prefill() and verify()
    advance it by the number of tokens fed; commit(n_keep) moves it back to the
    first n_keep tokens of the last verify.
    """

    def __init__(self, model: nn.Module, kv: str = "native", rollback: str = "capture", kv_group_size: int = 64):
        self.model = model
        self.kv, self.kv_group_size, self.strategy = kv, kv_group_size, rollback
        self.reset()

    def reset(self) -> None:
        self.cache, self.layout = make_cache(self.model, self.kv, self.kv_group_size)
        self.rollback = Rollback(self.model, self.cache, self.strategy, self._feed)
        self.offset = 0

    @property
    def vocab_size(self) -> int:
        return self.model.model.embed_tokens.weight.shape[0]

    def _feed(self, tokens: list[int]) -> mx.array:
        # [T] token ids -> [1, T, V] logits; caches advance, offset bookkeeping is the caller's.
        return self.model(mx.array(tokens, dtype=mx.int32)[None], cache=self.cache)

    def forward(self, tokens: list[int]) -> mx.array:
        """Feed `tokens` at the current offset; logits [T, V]."""
        self.offset += len(tokens)
        return self._feed(tokens)[0]

    def prefill(self, prompt: list[int]) -> mx.array:
        """Fresh cache, feed the prompt (in chunks); logits [V] at its last position."""
        assert prompt, "prefill needs at least one prompt token"
        self.reset()
        starts = range(0, len(prompt), PREFILL_CHUNK)
        for s in starts[:-1]:
            self.forward(prompt[s: s + PREFILL_CHUNK])
            mx.eval([c.state for c in self.cache])  # bound the lazy graph of long prompts
        return self.forward(prompt[starts[-1]:])[-1]

    def verify(self, tokens: list[int]) -> mx.array:
        """Feed `tokens` in one forward so commit() can keep any prefix; logits [T, V]."""
        with self.rollback.verify(tokens):
            logits = self.forward(tokens)
        return logits

    def commit(self, n_keep: int) -> None:
        """Keep the first n_keep tokens of the last verify, drop the rest (exact or raise)."""
        self.offset -= self.rollback.commit(n_keep)
