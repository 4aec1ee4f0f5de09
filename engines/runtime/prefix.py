"""A prompt prefix fed once and restored for every prompt that starts with it.

When every prompt of a run begins with the same long prefix (a system turn and bench.context's
earlier conversation), feeding it again for each warm-up, rep and profiled run costs minutes
on a CPU at 8k tokens and measures nothing new. A PrefixCache keeps, per cache configuration,
the target's cache state and the hidden states the drafters read after that prefix; Target.prefill
restores them and feeds only the rest, as a server's prompt cache would. The prefix is fed the
same way the first time (alone, then the rest), so every restore gives the same logits as the
first prefill, bit for bit. A prompt that does not start with the prefix is prefilled whole.
"""

from __future__ import annotations

import mlx.core as mx


def _copy(x):
    # New array objects for every array in a cache's state: a later in-place update of the
    # restored cache must not reach the snapshot.
    if isinstance(x, mx.array):
        return mx.array(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    return x


class PrefixCache:
    """Snapshots of a Target after `prefix` (token ids), one per cache configuration."""

    def __init__(self, prefix: list[int]):
        assert len(prefix) >= 1, "a prefix cache needs at least one token"
        self.prefix = [int(t) for t in prefix]
        self._ids = mx.array(self.prefix, dtype=mx.int32)
        self.snapshots: dict[tuple, tuple[list, mx.array | None]] = {}
        self.drafters: dict[tuple, list] = {}  # a drafter's cache states after its pass over the prefix
        self.fed = 0  # times the prefix was fed (once per configuration)
        self.restored = 0  # times a snapshot was restored
        self.drafter_fed = self.drafter_restored = 0

    def covers(self, ids) -> bool:
        """Whether `ids` (a list or a [T] array) start with the prefix and go on past it (the rest
        is what gets fed); only the first len(prefix) ids are read."""
        n = len(self.prefix)
        if len(ids) <= n:
            return False
        head = ids[:n]
        return (head.tolist() if isinstance(head, mx.array) else list(head)) == self.prefix

    def start(self, target) -> mx.array | None:
        """Leave `target` (freshly reset) holding the prefix: restored, or fed and kept the first
        time for its configuration. Returns the prefix's hidden states (or None)."""
        key = (id(target.model), target.kv, target.kv_group_size, target.strategy, tuple(target.hidden_layers))
        if key not in self.snapshots:
            hidden = target.forward_chunked(self._ids).hidden  # [1, n, len(hidden_layers) * H], or None
            mx.eval([c.state for c in target.cache], hidden)
            self.snapshots[key] = ([_copy(c.state) for c in target.cache], hidden)
            self.fed += 1
            return hidden
        states, hidden = self.snapshots[key]
        for c, s in zip(target.cache, states):
            c.state = _copy(s)
        target.offset = len(self.prefix)
        self.restored += 1
        return hidden

    def drafter_prefix(self, key: tuple, caches: list, fill) -> None:
        """Leave a drafter's fresh `caches` holding its pass over the prefix: restored from the snapshot
        kept under `key` (the drafter and what it was fed from), or made by fill() -- the drafter's own
        pass over the prefix positions alone -- and kept, the first time. A drafter that conditions on
        the target's states of the prefix then pays that pass once per cell, as the target its prefill;
        the rest of the prompt is its engine's to feed, so a restore gives the same state as the first
        pass, bit for bit."""
        if key in self.drafters:
            for c, (state, meta) in zip(caches, self.drafters[key]):
                c.state = _copy(state)
                if meta is not None:
                    c.meta_state = meta
            self.drafter_restored += 1
            return
        fill()
        mx.eval([c.state for c in caches])
        # a rotating cache's layout (offset, write index) is its meta_state; a plain KVCache has none
        self.drafters[key] = [(_copy(c.state), c.meta_state if hasattr(type(c), "meta_state") else None)
                              for c in caches]
        self.drafter_fed += 1

    def nbytes(self) -> int:
        total = 0
        for states, hidden in [*self.snapshots.values(), *((s, None) for s in self.drafters.values())]:
            stack = [states, hidden]
            while stack:
                x = stack.pop()
                if isinstance(x, mx.array):
                    total += x.nbytes
                elif isinstance(x, (list, tuple)):
                    stack.extend(x)
        return total


class PrefixStore:
    """The PrefixCache of the latest prefix asked for, kept across the cells of one process (a
    sweep's cells of one context share it); an older prefix is dropped with its snapshots."""

    def __init__(self):
        self.current: PrefixCache | None = None

    def get(self, prefix: list[int]) -> PrefixCache:
        if self.current is None or self.current.prefix != [int(t) for t in prefix]:
            self.current = PrefixCache(prefix)
        return self.current


def prefix_pass(prefix: PrefixCache | None, history: list[int], states: mx.array, key: tuple, caches: list,
                run) -> mx.array:
    """A drafter's pass over the prompt, split at a restored prefix. `states` [1, T, ...] are the
    target's states of the prompt that the drafter pairs with the next tokens (state t with token
    t + 1); where `prefix` covers the prompt, the drafter's pass over the pairs inside the prefix,
    run(states of the prefix, history[:n]), is made once or restored (PrefixCache.drafter_prefix)
    into `caches`. Returns the states the drafter has yet to see: all of them without a prefix."""
    if prefix is None or not prefix.covers(history[:-1]):
        return states
    n = len(prefix.prefix)
    prefix.drafter_prefix(key, caches, lambda: run(states[:, : n - 1], history[:n]))  # pairs t < n - 1
    return states[:, n - 1:]
