"""MTP head training: the engine's own MTPHead on a frozen target.

Position t pairs the target's final-normed hidden state at t with the embedding of token
t+1 and predicts token t+2; the head's decoder layer attends causally over the row, as its
cache does at inference when it first passes over verified positions. The loss is the soft
cross-entropy against the target's own distribution for token t+2, on answer tokens. The
export is a drafter directory whose safetensors hold the mtp.* tensors (the Qwen3-Next
form), which `method=mtp method.drafter=<dir>` reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engines.drafters.mtp import MTPHead, load_mtp, text_args
from engines.runtime.hidden import embed, final_norm, lm_head
from train.files import save_tensors
from train.objective import Objective, pad, shift, soft_ce, weighted_mean


class MTPObjective(Objective):
    kind = "mtp"

    @classmethod
    def check(cls, target, cfg) -> None:
        text_args(target)  # Unsupported for a target no MTP head is built for

    def __init__(self, target, tokenizer, cfg, rows, prompt_lens):
        super().__init__(target, tokenizer, cfg)
        mx.random.seed(cfg.seed)
        self.module = MTPHead(target)
        self.module.set_dtype(mx.float32)

    def batch(self, rows, prompt_lens, rng: random.Random) -> dict:
        ids, ans = pad(rows, prompt_lens)
        (last,), logits = self.capture(ids, (self.n_layers - 1,))
        return {"ids": ids, "ans": ans, "hidden": final_norm(self.target, last).astype(mx.float32),
                "teacher": mx.softmax(logits, axis=-1)}

    def loss(self, head: MTPHead, b: dict):
        out = head(embed(self.target, shift(b["ids"], 1)).astype(mx.float32), b["hidden"])  # (h_t, token t+1)
        logq = nn.log_softmax(lm_head(self.target, out), axis=-1)  # [B, T, V]
        teacher = shift(b["teacher"], 1)  # L_{t+1}: the distribution of token t+2
        w = shift(b["ans"], 2)
        acc = weighted_mean((mx.argmax(logq, -1) == mx.argmax(teacher, -1)).astype(mx.float32), w)
        return weighted_mean(soft_ce(logq, teacher), w), {"acc": acc[None], "n": w.sum()}

    def export(self, module, out: Path, dtype) -> None:
        out.mkdir(parents=True, exist_ok=True)
        weights = {f"mtp.{k}": v.astype(dtype) for k, v in tree_flatten(module.parameters())}
        save_tensors(out / "model.safetensors", weights, metadata={"format": "mlx"})
        (out / "config.json").write_text(json.dumps({"architectures": ["MTPHead"], "mtp_layout": "qwen3_next",
                                                     "target_model_type": self.target.model_type,
                                                     "hidden_size": self.hidden}, indent=2))

    def load(self, out: Path):
        return load_mtp(out, self.target)

