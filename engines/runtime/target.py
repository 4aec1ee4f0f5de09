"""The target model and its cache: the one place that runs target forwards.

Every engine prefills, verifies and rolls back through a Target, so cache handling
and exact rollback exist once. Token ids come in as lists or as device arrays; a
device array is never read here, so a draft can go from drafter to verify without a
host round trip.

Every call that runs the model returns a Forward: its logits, and the hidden states of
the layers the Target was built to keep (`hidden_layers`, declared at construction from
what the engine's drafter reads: Engine.hidden_layers) for the very tokens it fed.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from engines.kernels.gemm import available as gemm_available
from engines.kernels.gemm import small_m_linears
from engines.runtime.cache import Rollback, make_cache, trim_attention
from engines.runtime.dispatch import attention_modules, dispatch_defaults, stable_attention, staged
from engines.runtime.hidden import capture_hidden, vocab_size
from engines.runtime.prefix import PrefixCache
from engines.runtime.tree import check_tree_capable, compact, tree_attention

PREFILL_CHUNK = 2048


class Forward(NamedTuple):
    """What a target forward returns: logits, and the declared layers' hidden states of the same tokens."""

    logits: mx.array  # [T, V] (prefill: [V] at the last prompt position)
    hidden: mx.array | None  # [1, T, len(hidden_layers) * H], layers in declared order; None when none declared


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

    hidden_layers: the decoder layers whose outputs every forward keeps and returns in
    Forward.hidden (a drafter's input); fixed for the Target's life, () keeps none.
    """

    def __init__(self, model: nn.Module, kv: str = "native", rollback: str = "capture", kv_group_size: int = 64,
                 stage_every: int | None = None, stable_attention: bool | None = None,
                 small_m_gemm: bool | None = None, hidden_layers: tuple[int, ...] = ()):
        self.model = model
        self._hidden_layers = tuple(int(i) for i in hidden_layers)
        self.kv, self.kv_group_size, self.strategy = kv, kv_group_size, rollback
        auto = dispatch_defaults()  # engines/runtime/dispatch.py: None = what this device wants
        self.stage_every = auto["stage_every"] if stage_every is None else stage_every
        self.stable_attention = auto["stable_attention"] if stable_attention is None else stable_attention
        self.small_m_gemm = auto["small_m_gemm"] if small_m_gemm is None else small_m_gemm
        if self.small_m_gemm and not gemm_available():
            raise ValueError("small_m_gemm needs MLX's CUDA backend on the default device (engines/kernels/gemm.py)")
        self._attention = attention_modules(model) if self.stable_attention else []
        self.fed_tokens = 0  # tokens fed through the model since this Target was made: work, not time
        self.prefix: PrefixCache | None = None  # a prompt prefix fed once and restored (engines/runtime/prefix.py)
        self.vocab_size = vocab_size(model)
        self.reset()

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The layers whose outputs every forward returns (Forward.hidden), as declared when built."""
        return self._hidden_layers

    def reset(self) -> None:
        self.cache, self.layout = make_cache(self.model, self.kv, self.kv_group_size)
        self.rollback = Rollback(self.model, self.cache, self.strategy, self._replay)
        self.offset = 0
        self._last = None  # ids of the last verify (replay re-feeds a prefix of them)

    def set_strategy(self, strategy: str) -> None:
        """Switch the recurrent rollback strategy (takes effect at the next prefill)."""
        self.strategy = strategy
        self.reset()

    def stable(self):
        """A context in which layers of this target's own classes run outside a target forward
        (an MTP head) attend shape-stably as its forwards do (engines/runtime/dispatch.py); a no-op when off."""
        return stable_attention(self._attention)

    def _feed(self, ids: mx.array) -> Forward:
        # [T] ids -> logits [1, T, V] and hidden [1, T, n * H]; caches advance, offset bookkeeping is the caller's.
        inputs = ids[None]
        self.fed_tokens += ids.shape[0]
        if ids.shape[0] == 1 and not self.stage_every:  # a decode step: stable attention and the
            return self._run(inputs)                    # few-row kernel never touch one token
        with (staged(self.model, self.stage_every), stable_attention(self._attention),
              small_m_linears(self.small_m_gemm)):
            return self._run(inputs)

    def _run(self, inputs: mx.array) -> Forward:
        # [1, T] -> logits [1, T, V], with the declared layers' outputs [1, T, n * H] (None without any).
        if not self.hidden_layers:
            return Forward(self.model(inputs, cache=self.cache), None)
        with capture_hidden(self.model, self.hidden_layers) as sink:
            logits = self.model(inputs, cache=self.cache)
        return Forward(logits, mx.concatenate(sink, axis=-1))

    def _replay(self, ids: mx.array) -> mx.array:
        with self.rollback.plain():
            return self._feed(ids).logits

    def forward(self, tokens) -> Forward:
        """Feed `tokens` at the current offset (never rolled back); logits [T, V], hidden [1, T, n * H]."""
        ids = as_ids(tokens)
        self.offset += ids.shape[0]
        with self.rollback.plain():
            logits, hidden = self._feed(ids)
        return Forward(logits[0], hidden)

    def prefill(self, prompt, reuse: bool = True) -> Forward:
        """Fresh cache, feed the prompt (in chunks); logits [V] at its last position, hidden
        [1, T, n * H] for every prompt position. With a PrefixCache set and `reuse`, a prompt
        that starts with its prefix has the prefix (and its hidden states) restored and only
        the rest fed."""
        ids = as_ids(prompt)
        assert ids.shape[0] >= 1, "prefill needs at least one prompt token"
        self.reset()
        if not (reuse and self.prefix is not None and self.prefix.covers(ids)):
            logits, hidden = self.forward_chunked(ids)
            return Forward(logits[-1], hidden)
        head = self.prefix.start(self)
        logits, hidden = self.forward_chunked(ids[len(self.prefix.prefix):])
        if head is not None:
            hidden = mx.concatenate([head, hidden], axis=1)  # [1, T, n * H]: the prefix's, then the rest's
        return Forward(logits[-1], hidden)

    def forward_chunked(self, tokens) -> Forward:
        """forward() in chunks of PREFILL_CHUNK; logits [T_last_chunk, V], hidden [1, T, n * H] for all T."""
        ids = as_ids(tokens)
        starts = range(0, ids.shape[0], PREFILL_CHUNK)
        hidden = []
        for s in starts[:-1]:
            hidden.append(self.forward(ids[s: s + PREFILL_CHUNK]).hidden)
            mx.eval([c.state for c in self.cache], hidden)  # bound the lazy graph of long prompts
        logits, last = self.forward(ids[starts[-1]:])
        if self.hidden_layers and hidden:
            last = mx.concatenate([*hidden, last], axis=1)
        return Forward(logits, last)

    def verify(self, tokens) -> Forward:
        """Feed `tokens` in one forward so commit() can keep any prefix; logits [T, V], hidden [1, T, n * H]."""
        ids = as_ids(tokens)
        self._last = ids
        self.offset += ids.shape[0]
        with self.rollback.verify(ids.shape[0]):
            logits, hidden = self._feed(ids)
        return Forward(logits[0], hidden)

    def verify_sequential(self, tokens) -> Forward:
        """Like verify(), but one forward per token: the numerics of single-token decode
        at the cost of T forwards; logits [T, V], hidden [1, T, n * H]."""
        ids = as_ids(tokens)
        logits, hidden, snapshots = [], [], []
        recurrent = self.rollback.recurrent
        for t in range(ids.shape[0]):
            out = self.forward(ids[t: t + 1])
            logits.append(out.logits)
            hidden.append(out.hidden)
            snapshots.append([list(self.cache[i].cache) for i in recurrent])
        self.rollback.stepped(ids.shape[0], snapshots)
        return Forward(mx.concatenate(logits, axis=0), mx.concatenate(hidden, axis=1) if self.hidden_layers else None)

    def verify_tree(self, tokens, parents: list[int]) -> Forward:
        """[root] + tree nodes in one forward, each node at its depth's position seeing
        only its ancestors (engines/runtime/tree.py); logits [T, V], hidden [1, T, n * H] in node
        order. Attention-only targets."""
        check_tree_capable(self.cache)
        ids = as_ids(tokens)
        with tree_attention(self.model, parents):
            out = self.forward(ids)
        self._tree_size = ids.shape[0]
        return out

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
