"""Language-model pretraining: next-token cross-entropy on the rows' own tokens.

Not a drafter objective: it is how the fixture targets (train/fixtures.py) learn the
project's text through the same loop (train/loop.py) the drafters train in. The module is
the model itself; there is no teacher, and every position of a row is a label.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn

from train.objective import pad, shift, weighted_mean


class LanguageModelObjective:
    """The Objective interface train/loop.fit drives (module, batch, loss) over `model` itself."""

    kind = "lm"
    positions = 1

    def __init__(self, model: nn.Module):
        self.module = model

    def batch(self, rows: list[list[int]], prompt_lens: list[int], rng: random.Random) -> dict:
        ids, _ = pad(rows, prompt_lens)  # [B, T]
        real = mx.array([[t < len(r) for t in range(ids.shape[1])] for r in rows], dtype=mx.float32)
        return {"ids": ids, "w": shift(real, 1)}  # position t predicts token t+1 where one exists

    def loss(self, model: nn.Module, b: dict):
        logits = model(b["ids"]).astype(mx.float32)  # [B, T, V]
        ce = nn.losses.cross_entropy(logits, shift(b["ids"], 1), reduction="none")
        acc = weighted_mean((mx.argmax(logits, -1) == shift(b["ids"], 1)).astype(mx.float32), b["w"])
        return weighted_mean(ce, b["w"]), {"acc": acc[None], "n": b["w"].sum()}
