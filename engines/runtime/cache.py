"""Target caches: construction per KV dtype, and exact rollback for every cache type.

Rollback contract: after a verify forward over T tokens, `Rollback.commit(n_keep)`
leaves every cache exactly as if only the first `n_keep` of those tokens had been fed
(1 <= n_keep <= T). It either does that or raises RollbackError; it never leaves a
cache that is silently wrong.

Attention caches are trimmed in place:
- KVCache / QuantizedKVCache: move the offset back (the stale tail is overwritten by
  the next update, and never read because reads stop at the offset).
- RotatingKVCache: mlx-lm refuses to trim once the window is full (and a buffer that
  was trimmed anyway is later rotated onto live entries). A multi-token update leaves
  the buffer in temporal order holding window-1+T entries, so dropping the rejected
  tail is a slice; `_trim_rotating` then re-establishes the layout mlx-lm's next
  update expects, or raises if the window no longer holds enough history.

Recurrent (Gated DeltaNet, ArraysCache: conv state + recurrent state) layers cannot be
trimmed; three exact strategies are implemented (config `rollback`):
- "capture": the verify's recurrence keeps the state after every position (the fused
  CUDA kernel writes them as it goes; elsewhere the recurrence steps one position at a
  time, exactly as single-token decode does); the conv input is kept too. Rollback
  picks the state after position n_keep: no recompute, T states of memory per layer.
- "recompute": the verify runs the model's own multi-token recurrence and keeps its
  inputs; rollback re-runs the recurrence (only it, not the layer) over the n_keep
  accepted positions from the state before verify.
- "replay": snapshot + replay. The recurrent state before verify is kept (arrays
  are immutable, so this is a reference, not a copy); rollback restores it, trims
  every attention cache by T and re-feeds the n_keep accepted tokens: one extra
  target forward over n_keep tokens, no hooks into the model.
engines/kernels/deltanet.py holds the recurrence and the hook; `rollback=auto` (the default)
times all three on the cell's own model and picks the fastest (harness/calibrate.py).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from engines.kernels.deltanet import RecurrenceHook, kernel_available, recurrence
from engines.runtime.hidden import decoder

ROLLBACK_STRATEGIES = ("capture", "recompute", "replay")


class RollbackError(RuntimeError):
    """A cache could not be restored exactly; continuing would give wrong output."""


# ---------------------------------------------------------------- construction

class _StorageCast:
    """Store K/V in `storage_dtype`, hand them back in the model's dtype.

    Emulates a lower-precision KV cache on a higher-precision model: the rounding
    error of storage is real, compute stays in the model dtype.
    """

    storage_dtype = mx.float16

    def update_and_fetch(self, keys, values):
        dtype = keys.dtype
        k, v = super().update_and_fetch(keys.astype(self.storage_dtype), values.astype(self.storage_dtype))
        return k.astype(dtype), v.astype(dtype)


class CastKVCache(_StorageCast, KVCache):
    def __init__(self, storage_dtype):
        super().__init__()
        self.storage_dtype = storage_dtype


class CastRotatingKVCache(_StorageCast, RotatingKVCache):
    def __init__(self, storage_dtype, max_size, keep=0):
        super().__init__(max_size=max_size, keep=keep)
        self.storage_dtype = storage_dtype


@dataclass
class CacheLayout:
    """What `make_cache` built, for the record."""

    types: list[str]
    kv_converted: int  # attention caches stored in the requested KV dtype
    kv_native: int  # attention caches left native (e.g. sliding windows under q8)
    recurrent: int


def make_cache(model: nn.Module, kv: str, group_size: int = 64) -> tuple[list, CacheLayout]:
    """The model's own cache list with attention caches converted to KV dtype `kv`.

    kv: native | float16 | bfloat16 | q8 | q4. Quantized KV uses mlx-lm's
    QuantizedKVCache; mlx-lm has no quantized rotating cache, so sliding-window
    layers stay native under q8/q4 (counted in CacheLayout.kv_native).
    """
    caches = make_prompt_cache(model)  # the model's own make_cache, or one KVCache per layer
    converted = native = 0
    out = []
    for c in caches:
        new = _convert(c, kv, group_size)
        if isinstance(c, (KVCache, RotatingKVCache)):
            native += new is c
            converted += new is not c
        out.append(new)
    layout = CacheLayout([type(c).__name__ for c in out], converted, native,
                         sum(isinstance(c, ArraysCache) for c in out))
    return out, layout


def _convert(c, kv: str, group_size: int):
    if kv == "native" or not isinstance(c, (KVCache, RotatingKVCache)):
        return c
    if kv in ("float16", "bfloat16"):
        dtype = getattr(mx, kv)
        if isinstance(c, RotatingKVCache):
            return CastRotatingKVCache(dtype, max_size=c.max_size, keep=c.keep)
        return CastKVCache(dtype)
    if kv in ("q8", "q4"):
        if isinstance(c, RotatingKVCache):
            return c
        return QuantizedKVCache(group_size=group_size, bits=int(kv[1:]))
    raise ValueError(f"unknown kv dtype {kv!r}")


# ---------------------------------------------------------------- attention trims

def trim_attention(c, n: int) -> None:
    """Drop the last `n` positions of attention cache `c` exactly, or raise."""
    if n == 0:
        return
    if n < 0 or n > c.offset:
        raise RollbackError(f"cannot trim {n} positions from a cache holding {c.offset}")
    if isinstance(c, RotatingKVCache):
        _trim_rotating(c, n)
    elif isinstance(c, (KVCache, QuantizedKVCache)):
        c.offset -= n
    else:
        raise RollbackError(f"no exact rollback for cache type {type(c).__name__}")


def _temporal(c: RotatingKVCache, v: mx.array) -> mx.array:
    # [B, H, S, D] -> the valid entries, oldest first (mirrors mlx-lm's layout rules).
    if c._idx == v.shape[2]:
        return v
    if c._idx < c.offset:
        return mx.concatenate([v[..., : c.keep, :], v[..., c._idx:, :], v[..., c.keep: c._idx, :]], axis=2)
    return v[..., : c._idx, :]


def _trim_rotating(c: RotatingKVCache, n: int) -> None:
    keys, values = _temporal(c, c.keys), _temporal(c, c.values)
    if getattr(c, "_rollback_pad_offset", None) == c.offset:
        # Our own padding slot from the last trim is still there (no update since):
        # it holds no position, so it must not count as history.
        keys, values = (_drop_slot(v, c.keep) for v in (keys, values))
    held = keys.shape[2] - n  # entries left, covering positions [offset - held, offset)
    offset = c.offset - n
    c._rollback_pad_offset = None
    if offset >= c.max_size:
        # The next update needs the last window-1 positions (single-token updates
        # rotate in a window-sized buffer; multi-token updates keep window-1).
        if held < c.max_size - 1:
            raise RollbackError(
                f"sliding window lost history: {held} entries left, window {c.max_size} needs "
                f"{c.max_size - 1}; verify must feed the window through one multi-token update")
        keep = min(held, c.max_size)
        keys = _tail(keys[..., :held, :], keep, c.keep)
        values = _tail(values[..., :held, :], keep, c.keep)
        if keep < c.max_size:
            # Pad one slot at the oldest position: the next single-token update
            # writes there first, the next multi-token update drops it first.
            keys, values = (_pad_slot(v, c.keep) for v in (keys, values))
            c._rollback_pad_offset = offset
        c.keys, c.values, c._idx = keys, values, c.max_size
    else:
        if held != offset:
            raise RollbackError(f"sliding window holds {held} entries for {offset} positions")
        c.keys, c.values, c._idx = keys[..., :held, :], values[..., :held, :], held
    c.offset = offset


def _pad_slot(v: mx.array, keep: int) -> mx.array:
    return mx.concatenate([v[..., :keep, :], mx.zeros_like(v[..., :1, :]), v[..., keep:, :]], axis=2)


def _drop_slot(v: mx.array, keep: int) -> mx.array:
    return mx.concatenate([v[..., :keep, :], v[..., keep + 1:, :]], axis=2)


def _tail(v: mx.array, size: int, keep: int) -> mx.array:
    # Keep the first `keep` (attention-sink) entries and the most recent rest.
    if keep == 0:
        return v[..., v.shape[2] - size:, :]
    return mx.concatenate([v[..., :keep, :], v[..., v.shape[2] - (size - keep):, :]], axis=2)


# ---------------------------------------------------------------- recurrent layers

def recurrent_mixers(model: nn.Module, caches: list) -> list[tuple[int, nn.Module]]:
    """(cache index, Gated DeltaNet module) for every ArraysCache in `caches`."""
    layers = decoder(model).layers
    out = []
    for i, c in enumerate(caches):
        if isinstance(c, ArraysCache):
            mixer = getattr(layers[i], "linear_attn", None)
            if mixer is None or not hasattr(mixer, "conv1d"):
                raise RollbackError(
                    f"layer {i} keeps recurrent state in a {type(layers[i]).__name__} this harness "
                    "cannot capture; use rollback=replay")
            out.append((i, mixer))
    return out


class Rollback:
    """Exact rollback of one target's caches around each verify forward.

    Usage per round: `with rb.verify(T): logits = model(tokens, cache)`, then
    `rb.commit(n_keep)`. Every other forward runs inside `rb.plain()`, so recurrent
    layers take this backend's fused recurrence there too (engines/kernels/deltanet.py).
    """

    def __init__(self, model: nn.Module, caches: list, strategy: str, forward):
        if strategy not in ROLLBACK_STRATEGIES:
            raise ValueError(f"unknown rollback strategy {strategy!r}; valid: {', '.join(ROLLBACK_STRATEGIES)}")
        self.model, self.caches, self.strategy = model, caches, strategy
        self.forward = forward  # callable(tokens) -> logits, used by replay
        self.recurrent = [i for i, c in enumerate(caches) if isinstance(c, ArraysCache)]
        mixers = []
        if self.recurrent:
            try:
                mixers = recurrent_mixers(model, caches)
            except RollbackError:
                if strategy != "replay":
                    raise  # replay alone needs no access to the layers' internals
        self.mixers = [i for i, _ in mixers]
        self.hook = RecurrenceHook([m for _, m in mixers]) if mixers else None
        self.attention = [c for c in caches if not isinstance(c, ArraysCache)]
        self._pending = None

    def plain(self):
        """Context for a forward that is never rolled back (prefill, decode): the fused
        recurrence where this backend has one, else mlx-lm's own path untouched."""
        return self.hook("plain") if self.hook and kernel_available() else nullcontext()

    @contextmanager
    def verify(self, T: int):
        """Wrap the verify forward over T tokens so that commit() can undo part of it."""
        if not self.recurrent or T == 1:
            with self.plain():
                yield
            self._pending = ("trim", T, None)
        elif self.strategy == "replay":
            snap = [list(self.caches[i].cache) for i in self.recurrent]
            with self.plain():
                yield
            self._pending = ("replay", T, snap)
        else:
            with self.hook(self.strategy) as rec:
                yield
            kept = rec.states if self.strategy == "capture" else rec.inputs
            if len(kept) != len(self.mixers) or len(rec.conv_inputs) != len(self.mixers):
                raise RollbackError(f"recorded {len(kept)} recurrent layers, expected {len(self.mixers)}")
            self._pending = (self.strategy, T, rec)

    def stepped(self, T: int, snapshots: list[list]) -> None:
        """Record a sequential verify: T single-token forwards, with the recurrent
        caches' contents after each (snapshots[i] = [cache.cache per recurrent layer])."""
        self._pending = ("steps", T, snapshots)

    def commit(self, n_keep: int, tokens=None) -> int:
        """Keep the first n_keep verified positions, drop the rest exactly; returns the number
        dropped. `tokens` (the verified ids) is needed by the replay strategy only."""
        kind, T, data = self._pending
        self._pending = None
        if not 1 <= n_keep <= T:
            raise RollbackError(f"n_keep={n_keep} outside 1..{T}")
        if n_keep == T:
            return 0
        if kind == "replay":
            self._commit_replay(data, T, tokens[:n_keep])
            return T - n_keep
        for c in self.attention:
            trim_attention(c, T - n_keep)
        if kind == "steps":
            for i, saved in zip(self.recurrent, data[n_keep - 1]):
                self.caches[i].cache = list(saved)
        elif kind in ("capture", "recompute"):
            self._commit_recurrent(kind, data, T, n_keep)
        return T - n_keep

    def _commit_recurrent(self, kind: str, rec, T: int, n_keep: int) -> None:
        for slot, i in enumerate(self.mixers):
            conv_in = rec.conv_inputs[slot]  # [B, kernel-1 + T, C]
            width = conv_in.shape[1] - T
            cache = self.caches[i]
            cache[0] = mx.contiguous(conv_in[:, n_keep: n_keep + width, :])
            if kind == "capture":
                cache[1] = rec.states[slot][n_keep - 1]
            else:  # re-run the recurrence over the accepted prefix from the state before verify
                q, k, v, g, beta, state = rec.inputs[slot]
                cut = slice(0, n_keep)
                cache[1] = recurrence(q[:, cut], k[:, cut], v[:, cut], g[:, cut], beta[:, cut], state)[1]

    def _commit_replay(self, snap, T: int, kept) -> None:
        for i, saved in zip(self.recurrent, snap):
            self.caches[i].cache = list(saved)
        for c in self.attention:
            trim_attention(c, T)
        self.forward(kept)


def cache_nbytes(caches: list) -> int:
    """Bytes the caches hold on the device now: K/V buffers (allocated, not just filled),
    quantized parts, recurrent states."""
    from mlx.utils import tree_flatten

    total = 0
    for c in caches:
        for name in ("keys", "values", "cache"):
            part = getattr(c, name, None)
            if part is not None and not callable(part):
                total += sum(a.nbytes for _, a in tree_flatten(part) if isinstance(a, mx.array))
    return total


def logical_state(c) -> list[mx.array]:
    """What a cache means, independent of its buffer layout: the arrays that decide
    every future output. Two caches with equal logical state are interchangeable."""
    if isinstance(c, ArraysCache):
        return [x for x in c.cache if x is not None]
    if isinstance(c, RotatingKVCache):
        n = min(c.offset, c.max_size - 1)  # what the next query can still attend to
        return [_temporal(c, v)[..., -n:, :] if n else v[..., :0, :] for v in (c.keys, c.values)]
    if isinstance(c, QuantizedKVCache):
        return [mx.dequantize(*(x[..., : c.offset, :] for x in part), group_size=c.group_size, bits=c.bits)
                for part in (c.keys, c.values)]
    if isinstance(c, KVCache):
        return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    raise TypeError(f"no logical state for {type(c).__name__}")
