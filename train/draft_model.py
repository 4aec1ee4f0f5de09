"""Draft-model training: a shallow copy of the target distilled on the target's own answers.

The draft model is the target's own architecture with train.num_layers decoder layers,
initialised from target layers spread evenly over its depth (first and last included), with
the target's embedding, final norm and head; every weight then trains on the soft
cross-entropy against the target's next-token distribution at answer positions (knowledge
distillation, as DistillSpec aligns a draft with its target). The export is a plain mlx-lm
checkpoint (config.json, model.safetensors, the target's tokenizer), which
`method=draft_model method.drafter=<dir>` reads, as does mlx-lm's own `--draft-model`.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engines.drafters.draft_model import load_draft_model
from engines.drafters.mtp import DENSE
from engines.errors import Unsupported
from engines.runtime import shared_weights
from engines.runtime.hidden import decoder, num_layers
from engines.runtime.target import Target
from harness.errors import ConfigError
from train.files import save_tensors
from train.objective import Objective, pad, shift, soft_ce, weighted_mean


def kept_layers(n_target: int, n: int) -> list[int]:
    """n target layer ids spread evenly over 0..n_target-1, first and last included."""
    if n >= n_target:
        return list(range(n_target))
    if n == 1:
        return [n_target - 1]
    return sorted({round(i * (n_target - 1) / (n - 1)) for i in range(n)})


class DraftModelObjective(Objective):
    kind = "draft_model"

    @classmethod
    def check(cls, target, cfg) -> None:
        if getattr(target, "model_type", None) not in DENSE:
            raise Unsupported(f"train=draft_model builds a shallow copy of a dense target ({', '.join(DENSE)}); "
                              f"this is {getattr(target, 'model_type', '?')}")
        if any(k.endswith(".scales") for k, _ in tree_flatten(target.parameters())):
            raise Unsupported("train=draft_model copies the target's layers, so it needs an unquantized target: "
                              "load it in float32 or bfloat16 (a GGUF file is dequantized on load)")
        n = num_layers(target)
        if cfg.num_layers > n:
            raise ConfigError(f"train.num_layers={cfg.num_layers} is more than the target's {n} layers: a draft model "
                              f"keeps some of them; give {n} or fewer")

    def __init__(self, target, tokenizer, cfg, rows, prompt_lens):
        super().__init__(target, tokenizer, cfg)
        self.check(target, cfg)
        self.layer_ids = kept_layers(self.n_layers, cfg.num_layers)
        args = dataclasses.replace(self.args, num_hidden_layers=len(self.layer_ids))
        if getattr(args, "layer_types", None):  # per-layer attention kinds follow the layers kept
            args = dataclasses.replace(args, layer_types=[args.layer_types[i] for i in self.layer_ids])
        self.module = type(target)(args)
        self._copy_from_target()
        self.module.set_dtype(mx.float32)
        if cfg.share_embedding:  # the target's embedding, frozen: shipped as a reference, not a copy
            decoder(self.module).embed_tokens.freeze()

    def _copy_from_target(self) -> None:
        src = dict(tree_flatten(self.target.parameters()))
        mine = []
        for k, _ in tree_flatten(self.module.parameters()):
            parts = k.split(".")
            if parts[:2] == ["model", "layers"]:  # layer i of the draft is target layer layer_ids[i]
                parts[2] = str(self.layer_ids[int(parts[2])])
            mine.append((k, src[".".join(parts)]))
        self.module.load_weights(mine)
        assert len(decoder(self.module).layers) == len(self.layer_ids)

    def batch(self, rows, prompt_lens, rng: random.Random) -> dict:
        ids, ans = pad(rows, prompt_lens)
        logits = mx.stop_gradient(self.target(ids).astype(mx.float32))
        return {"ids": ids, "w": shift(ans, 1), "teacher": mx.softmax(logits, axis=-1)}  # position t predicts t+1

    def loss(self, module: nn.Module, b: dict):
        logq = nn.log_softmax(module(b["ids"]).astype(mx.float32), axis=-1)  # [B, T, V]
        acc = weighted_mean((mx.argmax(logq, -1) == mx.argmax(b["teacher"], -1)).astype(mx.float32), b["w"])
        return weighted_mean(soft_ce(logq, b["teacher"]), b["w"]), {"acc": acc[None], "n": b["w"].sum()}

    def export(self, module, out: Path, dtype) -> None:
        out.mkdir(parents=True, exist_ok=True)
        weights = {k: v.astype(dtype) for k, v in tree_flatten(module.parameters())}
        (out / shared_weights.MANIFEST).unlink(missing_ok=True)
        if self.cfg.share_embedding:
            name = next(k for k in weights if k.endswith("embed_tokens.weight"))
            shared_weights.write_manifest(out, {name: weights.pop(name)})
        save_tensors(out / "model.safetensors", weights, metadata={"format": "mlx"})
        config = {k: v for k, v in dataclasses.asdict(module.args).items() if v is not None}
        config.update(num_hidden_layers=len(self.layer_ids), draft_of_layers=self.layer_ids)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        self.tokenizer._tokenizer.save_pretrained(str(out))  # mlx_lm.load(<dir>) works on its own

    def load(self, out: Path):
        return load_draft_model(Path(out), Target(self.target))[0]

    def describe(self) -> dict:
        return {"layers_from_target": self.layer_ids, "num_layers": len(self.layer_ids),
                **({"embedding": "the target's, frozen and shared"} if self.cfg.share_embedding else {})}
