"""Batched answers without per-sequence host work: one graph per step for the whole batch.

mlx-lm's BatchGenerator serves many requests (continuous batching, per-request samplers,
stop sequences, log-probabilities), and pays for it with Python work per sequence per step:
at batch 256 that is ~18 ms a step over a bare forward on the CPU, and it kept a 135M model
on an H200 at ~9k answer tokens/s. Training data needs less: a fixed batch of prompts, one
sampler, the same token budget, end-of-sequence ids. This loop left-pads the prompts into
mlx-lm's BatchKVCache (its masks and per-row positions make the padding invisible),
prefills them in one call, then decodes the whole batch a step at a time, queuing each
step before reading the last (the host reads a step only every `CHECK_EVERY` steps, to
stop once every row has ended). Rows are cut after their first end-of-sequence id (not
kept, as mlx-lm's batch generation does not keep it).

Targets whose caches are not all plain KV caches (recurrent or sliding-window layers) are
not taken: `supported` says so, and the caller uses mlx-lm's generator for them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

CHECK_EVERY = 16  # steps between host reads of "has every row ended?"


def supported(model) -> bool:
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def decode(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], sample) -> list[list[int]]:
    """Each prompt's answer ids (at most max_new_tokens, cut before the first id in `eos`);
    `sample` maps logits [B, V] to ids [B]."""
    assert prompts and all(prompts), "decode needs at least one prompt, none empty"
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    x = mx.array([[0] * n + p for n, p in zip(pad, prompts)], dtype=mx.int32)  # [B, L] left-padded
    cache = [BatchKVCache(pad) for _ in make_prompt_cache(model)]
    stops = mx.array(sorted(eos) or [-1], dtype=mx.int32)
    y = sample(model(x, cache=cache)[:, -1, :])  # [B]
    steps, done = [y], (y[:, None] == stops[None]).any(axis=1)  # [B]: rows that have ended
    mx.async_eval(y, done)
    for n in range(1, max_new_tokens):
        if n % CHECK_EVERY == 0 and done.all().item():
            break
        y = sample(model(y[:, None], cache=cache)[:, -1, :])
        done = done | (y[:, None] == stops[None]).any(axis=1)
        steps.append(y)
        mx.async_eval(y, done)
    ids = mx.stack(steps, axis=1).tolist()  # [B, T]
    return [_cut(row, eos) for row in ids]


def _cut(row: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[:i]
    return row
