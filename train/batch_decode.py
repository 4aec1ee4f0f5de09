"""Batched answers without per-sequence host work: one graph per step for the whole batch.

mlx-lm's BatchGenerator serves many requests (continuous batching, per-request samplers,
stop sequences, log-probabilities), and pays for it with Python work per sequence per step:
at batch 256 that is ~18 ms a step over a bare forward on the CPU, and it kept a 135M model
on an H200 at ~9k answer tokens/s. Training data needs less: a list of prompts, one sampler,
the same token budget, end-of-sequence ids. This loop left-pads prompts into mlx-lm's
BatchKVCache (its masks and per-row positions make the padding invisible), prefills them in
one call, then decodes the whole batch a step at a time, queuing each step before reading
the last. The host reads the newest `CHECK_EVERY` steps at once; rows whose answers have
ended then leave the batch (BatchKVCache.filter), so later steps compute only live rows.
Rows are cut before their first end-of-sequence id (not kept, as mlx-lm's batch generation
does not keep it).

`admit` < width refills freed rows with the next prompts (BatchKVCache.extend) instead of
waiting for the batch to empty; measured on the H200, that ran slower than a batch at a time
(docs/benchmarks/2026-12-04-smollm2-run5), so a batch at a time is the default.

Targets whose caches are not all plain KV caches (recurrent or sliding-window layers) are
not taken: `supported` says so, and the caller uses mlx-lm's generator for them.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

CHECK_EVERY = 16  # steps between host reads: rows that ended leave the batch


def supported(model) -> bool:
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def decode(model, prompts: list[list[int]], max_new_tokens: int, eos: set[int], sample,
           width: int | None = None, admit: int | None = None) -> list[list[int]]:
    """Each prompt's answer ids (at most max_new_tokens, cut before the first id in `eos`), at
    most `width` rows decoding at once (null: all of them), taken in list order, new rows
    admitted `admit` at a time (null: a batch at a time); `sample` maps logits [B, V]
    to ids [B]. A row's answer does not depend on the rows beside it."""
    assert prompts and all(prompts), "decode needs at least one prompt, none empty"
    width = min(width or len(prompts), len(prompts))
    admit = min(admit or width, width)
    answers: list[list[int]] = [[] for _ in prompts]
    waiting = list(range(len(prompts)))[::-1]  # popped from the end: list order
    live, cache, y = [], None, None  # prompt index per row; caches; [B] each row's newest token, not yet fed
    while live or waiting:
        if waiting and (width - len(live) >= admit or not live):
            free = min(width - len(live), len(waiting))
            new = [waiting.pop() for _ in range(free - free % admit if free >= admit else free)]
            cache, y = _admit(model, [prompts[i] for i in new], sample, cache, y)
            live += new
        block = [y]
        for _ in range(CHECK_EVERY):
            y = sample(model(y[:, None], cache=cache)[:, -1, :])
            block.append(y)
            mx.async_eval(y)
        for i, row in zip(live, mx.stack(block[:-1], axis=1).tolist()):  # [B, CHECK_EVERY]: the fed tokens
            answers[i] += row
        keep = [r for r, i in enumerate(live) if not _ended(answers[i], max_new_tokens, eos)]
        if len(keep) < len(live):
            cache, y = _retire(cache, y, keep)
            live = [live[r] for r in keep]
    return [_cut(a, eos)[:max_new_tokens] for a in answers]


def _admit(model, prompts: list[list[int]], sample, cache, y):
    # Prefill `prompts` left-padded in their own caches, then append them as rows of the batch.
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    x = mx.array([[0] * n + p for n, p in zip(pad, prompts)], dtype=mx.int32)  # [b, L] left-padded
    fresh = [BatchKVCache(pad) for _ in make_prompt_cache(model)]
    first = sample(model(x, cache=fresh)[:, -1, :])  # [b]
    if cache is None:
        return fresh, first
    for c, f in zip(cache, fresh):
        c.extend(f)
    return cache, mx.concatenate([y, first])


def _retire(cache, y, keep: list[int]):
    # Keep rows `keep` of the batch (None when no row is left).
    if not keep:
        return None, None
    rows = mx.array(keep, dtype=mx.int32)
    for c in cache:
        c.filter(rows)
    return cache, y[rows]


def _ended(answer: list[int], max_new_tokens: int, eos: set[int]) -> bool:
    return len(answer) >= max_new_tokens or any(t in eos for t in answer[-CHECK_EVERY:])


def _cut(row: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in eos:
            return row[:i]
    return row
