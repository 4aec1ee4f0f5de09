"""How a target forward reaches a CUDA device: shape-stable attention, and staged dispatch.

A forward over T > 1 tokens sends attention to cuDNN, whose plans MLX builds per exact
K/V shape. Every round of a speculative method attends over a new key count, in the
verify and in the drafter, so a round pays two plan builds whenever its context length
has not been seen in this process. `stable_attention` attends over the cache's whole
buffer instead (mlx-lm grows it 256 keys at a time), with one additive mask per forward
hiding what is not written yet, so one plan serves every round in that bucket (a tree
verify's boolean mask is padded alike; the drafters attend the same way: DFlash's and
EAGLE-3's own attention, and the MTP head, a layer of the target's class, through
Target.stable()). Measured
on the H200 (random llama-1b, bf16, DFlash block 8, docs/benchmarks/2026-12-01-h200):
with every shape new (a 16-plan cache) a round costs 8.0 ms with it, and z-lab's
reference, without it, 109 ms; with every shape already planned (the same prompt
replayed) the paired ratio against z-lab was 1.04x with it and 1.11x without, CIs
overlapping. On by default under CUDA; off elsewhere (Metal and the CPU build no
per-shape plans, and on the CPU the padded keys cost what they compute).

A tree verify's boolean mask becomes one additive mask per forward: MLX would otherwise convert
it in every layer's attention call.

`staged` queues the graph every few layers (mx.async_eval on a layer's output), so the
device could start on the first layers while Python builds the rest. On the H200 it did
not pay (0.985x and 0.998x z-lab with it, 1.037x and 1.109x without; 0.990x against
1.002x mlx-lm for base decoding), so it is off by default everywhere;
`dispatch.stage_every=N` tries it on other hosts.

Neither changes what is computed: async_eval only queues, and masked keys get weight 0;
the CPU suite runs both forced on and compares tokens. Like every other hook here, they
are installed for one forward and always undone.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from engines.runtime.hidden import decoder, hooked_layers
from engines.runtime.patches import attention_function


def dispatch_defaults() -> dict:
    """{stage_every, stable_attention, small_m_gemm, fuse_rounds} for the current device (see the
    module docstring, engines/kernels/gemm.py for small_m_gemm, engines/methods/device.py for fuse_rounds: off
    until measured to pay on a device)."""
    cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    return {"stage_every": 0, "stable_attention": cuda, "small_m_gemm": cuda, "fuse_rounds": False}


@contextmanager
def staged(model: nn.Module, every: int):
    """Within the block, forwards queue their graph after every `every`-th layer (0: never)."""
    n = len(decoder(model).layers)
    picked = range(every - 1, n - 1, every) if every > 0 else ()
    with hooked_layers(model, {i: lambda h: mx.async_eval(h) for i in picked}):
        yield


def attention_modules(model: nn.Module) -> list:
    """The modules whose attention classes call mlx-lm's scaled_dot_product_attention by name
    (found once per model: walking its modules every forward would cost more than it saves)."""
    names = {type(m).__module__ for _, m in model.named_modules() if type(m).__name__.endswith("Attention")}
    return [sys.modules[n] for n in sorted(names) if hasattr(sys.modules.get(n), "scaled_dot_product_attention")]


def _bucketed(original, masks: dict):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        # queries [B, H, T, D]; cache.keys [B, Hkv, S, D] with S >= offset (mlx-lm's growth step)
        T, K = queries.shape[2], keys.shape[2]
        if T == 1 or type(cache) is not KVCache or sinks is not None or cache.keys.shape[2] == K:
            return original(queries, keys, values, cache, scale, mask, sinks)
        S = cache.keys.shape[2]
        if isinstance(mask, str) and mask == "causal":
            key = (cache.offset, T, S, queries.dtype)
            if key not in masks:  # one additive mask per forward, shared by its layers (no per-layer conversion)
                qpos = mx.arange(cache.offset - T, cache.offset)  # the offset already counts these T
                visible = mx.arange(S)[None] <= qpos[:, None]  # [T, S]: causal, and nothing past the end
                masks[key] = mx.where(visible, mx.array(0, queries.dtype), mx.array(-mx.inf, queries.dtype))
            padded = masks[key]
        elif isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape[-1] == K:
            # a tree verify's [T, K] mask: the unwritten tail hidden, made additive once for every layer
            padded = additive(pad_keys(mask, S, masks), queries.dtype, masks)
        else:
            return original(queries, keys, values, cache, scale, mask, sinks)
        return mx.fast.scaled_dot_product_attention(queries, cache.keys, cache.values, scale=scale, mask=padded)
    scaled_dot_product_attention.bucketed = True
    return scaled_dot_product_attention


def pad_keys(mask: mx.array, S: int, masks: dict | None = None) -> mx.array:
    """A boolean [..., T, K] mask over the first K of S buffered keys -> [..., T, S], the rest
    unseen. With `masks` (one forward's), layers given the same mask object share one padding."""
    key = ("pad", id(mask), S)
    if masks is not None and key in masks and masks[key][0] is mask:
        return masks[key][1]
    tail = mx.zeros((*mask.shape[:-1], S - mask.shape[-1]), dtype=mx.bool_)
    padded = mx.concatenate([mask, tail], axis=-1)
    if masks is not None:
        masks[key] = (mask, padded)  # the mask kept alive with it: its id cannot be reused in this forward
    return padded


def additive(mask: mx.array, dtype, masks: dict | None = None) -> mx.array:
    """A boolean mask -> 0 where seen, -inf where not, in `dtype`: what MLX's CUDA attention
    converts it to in every call; with `masks` (one forward's), converted once for all layers."""
    key = ("additive", id(mask), dtype)
    if masks is not None and key in masks and masks[key][0] is mask:
        return masks[key][1]
    out = mx.where(mask, mx.array(0, dtype), mx.array(-mx.inf, dtype))
    if masks is not None:
        masks[key] = (mask, out)  # the mask kept alive with it, as in pad_keys
    return out


@contextmanager
def stable_attention(modules: list):
    """Within the block, causal multi-token attention over a plain KVCache in these
    `attention_modules` runs over the cache's whole buffer, masked (module docstring); the swap
    itself is engines/runtime/patches.py `attention_function`. Nested, it installs once."""
    masks: dict = {}
    with attention_function(modules, lambda f: f if getattr(f, "bucketed", False) else _bucketed(f, masks)):
        yield
