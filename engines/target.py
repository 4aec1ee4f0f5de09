"""The target model and its cache: the one place that runs target forwards.

Every engine prefills, verifies and rolls back through a Target, so cache handling
and exact rollback exist once. Token ids come in as lists or as device arrays; a
device array is never read here, so a draft can go from drafter to verify without a
host round trip.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from engines.cache import Rollback, make_cache, trim_attention
from engines.dispatch import attention_modules, dispatch_defaults, stable_attention, staged
from engines.gemm import available as gemm_available, small_m_linears
from engines.hidden import capture_hidden, vocab_size
from engines.prefix import PrefixCache
from engines.tree import check_tree_capable, compact, tree_attention

PREFILL_CHUNK = 2048


def as_ids(tokens) -> mx.array:
    """[T] integer ids from a list of ints (int32) or an array (passed as it is: lazy, no cast op)."""
    if isinstance(tokens, mx.array):
        return tokens
    return mx.array(tokens, dtype=mx.int32)


class Target:
    """A loaded mlx-lm model plus one sequence's cache.

    State after each call: `offset` tokens are in the cache. prefill() and verify()
    advance it by the number of tokens fed; commit(n_keep) moves it back to the
    first n_keep tokens of the last verify.
    """

    def __init__(self, model: nn.Module, kv: str = "native", rollback: str = "capture", kv_group_size: int = 64,
                 stage_every: int | None = None, stable_attention: bool | None = None,
                 small_m_gemm: bool | None = None):
        self.model = model
        self.kv, self.kv_group_size, self.strategy = kv, kv_group_size, rollback
        auto = dispatch_defaults()  # engines/dispatch.py: None = what this device wants
        self.stage_every = auto["stage_every"] if stage_every is None else stage_every
        self.stable_attention = auto["stable_attention"] if stable_attention is None else stable_attention
        self.small_m_gemm = auto["small_m_gemm"] if small_m_gemm is None else small_m_gemm
        if self.small_m_gemm and not gemm_available():
            raise ValueError("small_m_gemm needs MLX's CUDA backend on the default device (engines/gemm.py)")
        self._attention = attention_modules(model) if self.stable_attention else []
        self.hidden_layers: tuple[int, ...] = ()  # layer outputs to keep from every forward (set by drafters)
        self.hidden: mx.array | None = None  # [1, T, len(hidden_layers) * H] of the last forward
        self.fed_tokens = 0  # tokens fed through the model since this Target was made: work, not time
        self.prefix: PrefixCache | None = None  # a prompt prefix fed once and restored (engines/prefix.py)
        self.vocab_size = vocab_size(model)
        self.reset()

    def reset(self) -> None:
        self.cache, self.layout = make_cache(self.model, self.kv, self.kv_group_size)
        self.rollback = Rollback(self.model, self.cache, self.strategy, self._replay)
        self.offset = 0
        self._last = None  # ids of the last verify (replay re-feeds a prefix of them)

    def set_strategy(self, strategy: str) -> None:
        """Switch the recurrent rollback strategy (takes effect at the next prefill)."""
        self.strategy = strategy
        self.reset()

    def _feed(self, ids: mx.array) -> mx.array:
        # [T] ids -> [1, T, V] logits; caches advance, offset bookkeeping is the caller's.
        inputs = ids[None]
        self.fed_tokens += ids.shape[0]
        if ids.shape[0] == 1 and not self.stage_every:  # a decode step: stable attention and the
            return self._run(inputs)                    # few-row kernel never touch one token
        with (staged(self.model, self.stage_every), stable_attention(self._attention),
              small_m_linears(self.small_m_gemm)):
            return self._run(inputs)

    def _run(self, inputs: mx.array) -> mx.array:
        # [1, T] -> [1, T, V], keeping the hidden states drafters read.
        if not self.hidden_layers:
            return self.model(inputs, cache=self.cache)
        with capture_hidden(self.model, self.hidden_layers) as sink:
            logits = self.model(inputs, cache=self.cache)
        self.hidden = mx.concatenate(sink, axis=-1)  # [1, T, n * H]
        return logits

    def _replay(self, ids: mx.array) -> mx.array:
        with self.rollback.plain():
            return self._feed(ids)

    def forward(self, tokens) -> mx.array:
        """Feed `tokens` at the current offset (never rolled back); logits [T, V]."""
        ids = as_ids(tokens)
        self.offset += ids.shape[0]
        with self.rollback.plain():
            return self._feed(ids)[0]

    def prefill(self, prompt, reuse: bool = True) -> mx.array:
        """Fresh cache, feed the prompt (in chunks); logits [V] at its last position. With a
        PrefixCache set and `reuse`, a prompt that starts with its prefix has the prefix restored
        and only the rest fed (self.hidden still covers every prompt position)."""
        ids = as_ids(prompt)
        assert ids.shape[0] >= 1, "prefill needs at least one prompt token"
        self.reset()
        if not (reuse and self.prefix is not None and self.prefix.covers(ids.tolist())):
            return self.forward_chunked(ids)[-1]
        head = self.prefix.start(self)
        logits = self.forward_chunked(ids[len(self.prefix.prefix):])
        if head is not None:
            self.hidden = mx.concatenate([head, self.hidden], axis=1)  # [1, T, n * H]: the prefix's, then the rest's
        return logits[-1]

    def forward_chunked(self, tokens) -> mx.array:
        """forward() in chunks of PREFILL_CHUNK; logits [T_last_chunk, V], hidden for all T."""
        ids = as_ids(tokens)
        starts = range(0, ids.shape[0], PREFILL_CHUNK)
        hidden = []
        for s in starts[:-1]:
            self.forward(ids[s: s + PREFILL_CHUNK])
            hidden.append(self.hidden)
            mx.eval([c.state for c in self.cache], hidden)  # bound the lazy graph of long prompts
        logits = self.forward(ids[starts[-1]:])
        if self.hidden_layers and hidden:
            self.hidden = mx.concatenate([*hidden, self.hidden], axis=1)
        return logits

    def verify(self, tokens) -> mx.array:
        """Feed `tokens` in one forward so commit() can keep any prefix; logits [T, V]."""
        ids = as_ids(tokens)
        self._last = ids
        self.offset += ids.shape[0]
        with self.rollback.verify(ids.shape[0]):
            return self._feed(ids)[0]

    def verify_sequential(self, tokens) -> mx.array:
        """Like verify(), but one forward per token: the numerics of single-token decode
        at the cost of T forwards; logits [T, V]."""
        ids = as_ids(tokens)
        logits, hidden, snapshots = [], [], []
        recurrent = self.rollback.recurrent
        for t in range(ids.shape[0]):
            logits.append(self.forward(ids[t: t + 1]))
            hidden.append(self.hidden)
            snapshots.append([list(self.cache[i].cache) for i in recurrent])
        if self.hidden_layers:
            self.hidden = mx.concatenate(hidden, axis=1)
        self.rollback.stepped(ids.shape[0], snapshots)
        return mx.concatenate(logits, axis=0)

    def verify_tree(self, tokens, parents: list[int]) -> mx.array:
        """[root] + tree nodes in one forward, each node at its depth's position seeing
        only its ancestors (engines/tree.py); logits [T, V]. Attention-only targets."""
        check_tree_capable(self.cache)
        ids = as_ids(tokens)
        with tree_attention(self.model, parents):
            logits = self.forward(ids)
        self._tree_size = ids.shape[0]
        return logits

    def commit_tree(self, keep: list[int]) -> None:
        """Keep tree entries `keep` (root and accepted path, increasing) and drop the rest."""
        compact(self.cache, self._tree_size, keep)
        self.offset -= self._tree_size - len(keep)

    def mark(self) -> tuple:
        """Where the cache is now, to rewind() to later (recurrent states by reference)."""
        return self.offset, [(i, list(self.cache[i].cache)) for i in self.rollback.recurrent]

    def rewind(self, mark: tuple) -> None:
        """Drop everything fed since mark(): attention caches are trimmed exactly, recurrent
        states restored (their arrays are never modified in place)."""
        offset, recurrent = mark
        for c in self.rollback.attention:
            trim_attention(c, self.offset - offset)
        for i, saved in recurrent:
            self.cache[i].cache = list(saved)
        self.offset = offset

    def commit(self, n_keep: int) -> None:
        """Keep the first n_keep tokens of the last verify, drop the rest (exact or raise)."""
        self.offset -= self.rollback.commit(n_keep, self._last)
