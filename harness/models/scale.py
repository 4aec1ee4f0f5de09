"""Random-weight checkpoints at real models' shapes, built locally (nothing is downloaded).

`python -m harness.models.scale <preset> <dir>` writes a checkpoint directory (config.json,
bf16 model.safetensors, the fixture tokenizer) of a real model's shape (Llama 3.2 1B / 3B,
Llama 3.1 8B, Qwen2.5 0.5B / 1.5B / 7B, a ~1B Qwen3.5) and beside it its drafters, random and
of matching shape: `<dir>-dflash` (2 layers, z-lab layout, block 8), `<dir>-eagle3` (one layer
of the target's width, a 32k draft vocabulary, speculators layout) and `<dir>-mtp` (one MTP
layer of the target's own class). A draft model is the family's smaller preset (DRAFT_MODEL).
Outputs are meaningless, so acceptance is near zero: such a pair measures pure cost -- a
decode step, a verify of K+1 tokens, a rollback, a drafting round -- at the size users run;
with `method.force.accepted` (engines/runtime/forced.py) it measures a round's cost at a chosen tau:

    python -m harness.models.scale qwen35-1b /tmp/qwen35-1b
    python -m harness arch=llama arch.model=scale:llama-8b arch.dtype=native method=eagle3 method.force.accepted=3

`arch.model=scale:<preset>` (and `method.drafter=scale:<preset>`: that preset's drafter of the
method's kind) builds them on first use under SPEC_HARNESS_HOME, as the fixtures are, and again
when the preset's shape or the fixture tokenizer changes. Vocabularies are the real ones (the
LM head is a large part of a small model's step); the fixture tokenizer uses ids below 1024.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import sys
from pathlib import Path

from engines.drafters import DRAFTERS
from engines.home import home
from harness.models import fixtures

_LLAMA = {"model_type": "llama", "rope_theta": 500000.0, "vocab_size": 128256, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 8192}
_QWEN2 = {"model_type": "qwen2", "rope_theta": 1000000.0, "vocab_size": 151936, "rms_norm_eps": 1e-6,
          "max_position_embeddings": 32768, "head_dim": 128}  # head_dim: hidden / heads (read by the drafters)

PRESETS = {
    "llama-1b": {**_LLAMA, "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,  # Llama 3.2 1B
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "llama-3b": {**_LLAMA, "hidden_size": 3072, "num_hidden_layers": 28, "intermediate_size": 8192,  # Llama 3.2 3B
                 "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "llama-8b": {**_LLAMA, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,  # Llama 3.1 8B
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
    "qwen2.5-0.5b": {**_QWEN2, "hidden_size": 896, "num_hidden_layers": 24, "intermediate_size": 4864,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {**_QWEN2, "hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True},
    # (Qwen2.5 7B pads its embedding to 152064 rows; the preset keeps the tokenizer's 151936, 0.08% of its
    # head, so its 0.5B draft model passes the draft model's vocabulary check)
    "qwen2.5-7b": {**_QWEN2, "hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False},
    "qwen35-1b": {"model_type": "qwen3_5", "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 6144,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "full_attention_interval": 4,
                  "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 32000,
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 8192,
                  "rope_parameters": {"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}},
    # The same layouts at toy size, so tests can build and run a preset and its draft model in seconds.
    "llama-tiny": {**_LLAMA, "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
                   "tie_word_embeddings": True},
    "llama-tiny-draft": {**_LLAMA, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
                         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1024,
                         "tie_word_embeddings": True},
}

# A target preset -> the preset of its family's smaller shape, its draft model (as Llama 3.2 1B drafts for
# Llama 3.1 8B, Qwen2.5 0.5B for 1.5B and 7B); presets without one have no smaller sibling of their family.
DRAFT_MODEL = {"llama-3b": "llama-1b", "llama-8b": "llama-1b", "qwen2.5-1.5b": "qwen2.5-0.5b",
               "qwen2.5-7b": "qwen2.5-0.5b", "llama-tiny": "llama-tiny-draft"}

# the random drafters built beside every preset: each kind whose drafter is not a whole model (engines/drafters)
DRAFTER_KINDS = tuple(k for k, d in DRAFTERS.items() if d.found != "model")
EAGLE3_DRAFT_VOCAB = 32000  # as EAGLE-3's releases for Llama 3.1 8B
BUILD = 2  # bump when what a build writes changes: built presets are then rebuilt


def build(preset: str, dest: Path) -> None:
    """The target checkpoint of `preset` in `dest`, and its random drafters beside it (drafter_dir)."""
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    spec = PRESETS[preset]
    module = importlib.import_module(f"mlx_lm.models.{spec['model_type']}")
    mx.random.seed(fixtures.SEED)
    model = module.Model(module.ModelArgs.from_dict(dict(spec)))
    fixtures.cast_model(model, mx.bfloat16)
    dest.mkdir(parents=True, exist_ok=True)
    fixtures.write_tokenizer(dest)  # ids < 1024 only: a subset of the model's vocabulary
    save_model(dest, model)
    save_config(dict(spec), dest / "config.json")
    for kind in DRAFTER_KINDS:
        BUILDERS[kind](preset, model, drafter_dir(dest, kind))
    (dest / "scale.json").write_text(json.dumps({"preset": preset, "build": build_hash(preset)}))  # last: complete


def drafter_dir(target_dir: Path, kind: str) -> Path:
    """Where the random `kind` drafter (one of DRAFTER_KINDS) of a built preset lies."""
    return target_dir.with_name(f"{target_dir.name}-{kind}")


def dflash_spec(preset: str) -> dict:
    """A 2-layer DFlash drafter shaped for `preset` (z-lab layout, block 8)."""
    spec = PRESETS[preset]
    n = spec["num_hidden_layers"]
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": spec["hidden_size"],
            "num_hidden_layers": 2, "num_attention_heads": spec["num_attention_heads"],
            "num_key_value_heads": spec["num_key_value_heads"], "head_dim": spec["head_dim"],
            "intermediate_size": spec["intermediate_size"], "rms_norm_eps": spec["rms_norm_eps"],
            "rope_theta": 10000000.0, "max_position_embeddings": spec["max_position_embeddings"],
            "vocab_size": spec["vocab_size"], "num_target_layers": n, "block_size": 8,
            "dflash_config": {"target_layer_ids": sorted({1, n // 2, n - 2}), "mask_token_id": fixtures.MASK_TOKEN_ID}}


def eagle3_spec(preset: str) -> dict:
    """A one-layer EAGLE-3 drafter of `preset`'s width (speculators layout): features of its low, middle
    and high layers, a draft vocabulary of the first EAGLE3_DRAFT_VOCAB ids."""
    from engines.drafters.eagle3 import default_aux_layers  # MLX: a spec resolves without

    spec = PRESETS[preset]
    layer = {k: spec[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                  "intermediate_size", "rms_norm_eps", "max_position_embeddings", "vocab_size")}
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "draft_vocab_size": min(EAGLE3_DRAFT_VOCAB, spec["vocab_size"]), "target_hidden_size": spec["hidden_size"],
            "norm_before_residual": False,
            # (a toy depth makes the low and mid picks the same layer: features of each once)
            "eagle_aux_hidden_state_layer_ids": sorted(set(default_aux_layers(spec["num_hidden_layers"]))),
            "transformer_layer_config": {"model_type": "llama", "rope_theta": 10000.0, **layer}}


def build_dflash(preset: str, model, dest: Path) -> None:
    import mlx.core as mx

    from engines.drafters.dflash import (DFlashConfig, DFlashDrafter,  # MLX, mlx-lm: a spec resolves without
                                         save_drafter)

    mx.random.seed(fixtures.SEED + 1)
    spec = dflash_spec(preset)
    save_drafter(DFlashDrafter(DFlashConfig.from_json(spec, f"dflash_spec({preset})")), dest)


def build_eagle3(preset: str, model, dest: Path) -> None:
    import mlx.core as mx

    from engines.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3

    mx.random.seed(fixtures.SEED + 2)
    save_eagle3(Eagle3Drafter(Eagle3Config.from_json(eagle3_spec(preset), f"eagle3_spec({preset})")), dest)


def build_mtp(preset: str, model, dest: Path) -> None:
    """One MTP layer of the target's own class and width (engines/methods/mtp.py), in the drafter form train/ writes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engines.drafters.mtp import MTPHead
    from engines.runtime.checkpoint import write_checkpoint

    mx.random.seed(fixtures.SEED + 3)
    head = MTPHead(model)
    write_checkpoint(dest, {"architectures": ["MTPHead"], "target_model_type": model.model_type,
                            "hidden_size": model.args.hidden_size},
                     {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})


BUILDERS = {"dflash": build_dflash, "eagle3": build_eagle3, "mtp": build_mtp}  # kind -> (preset, target, dir)


def build_hash(preset: str) -> str:
    """What a build of `preset` depends on: its shape, its drafters' specs, the fixture tokenizer."""
    blob = json.dumps({"build": BUILD, "spec": PRESETS[preset], "dflash": dflash_spec(preset),
                       "eagle3": eagle3_spec(preset),
                       "tokenizer": hashlib.sha256((fixtures.SHIPPED_DIR / "tokenizer.json").read_bytes()).hexdigest()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _built(dest: Path, preset: str) -> bool:
    # complete (its stamp, written last), of this build, and holding the shipped tokenizer: a build from
    # before the fixture tokenizer was retrained would tokenize prompts differently from a fresh one
    try:
        stamp = json.loads((dest / "scale.json").read_text())["build"]
        built_tokenizer = (dest / "tokenizer.json").read_bytes()
    except (OSError, ValueError, KeyError, TypeError):  # absent, cut short or from an older build
        return False
    return stamp == build_hash(preset) and built_tokenizer == (fixtures.SHIPPED_DIR / "tokenizer.json").read_bytes()


def checkpoint_dir(preset: str) -> Path:
    """`scale:<preset>`: the checkpoint built on first use under SPEC_HARNESS_HOME (and again when its
    build changes), with its drafters beside it."""
    if preset not in PRESETS:
        raise KeyError(f"unknown scale preset {preset!r}; available: {', '.join(sorted(PRESETS))}")
    dest = home() / "scale" / preset
    if not _built(dest, preset):
        tmp = dest.with_name(f".{preset}.building")
        for d in (tmp, *(drafter_dir(tmp, k) for k in DRAFTER_KINDS)):
            shutil.rmtree(d, ignore_errors=True)  # a build cut short
        build(preset, tmp)
        for kind in (*DRAFTER_KINDS, None):  # the target last: its stamp says the drafters are there
            d, final = (drafter_dir(tmp, kind), drafter_dir(dest, kind)) if kind else (tmp, dest)
            if final.exists():
                shutil.rmtree(final)
            d.rename(final)
    return dest


def draft_model_preset(preset: str) -> str | None:
    """The preset whose shape drafts for `preset` (its family's smaller one), or None."""
    return DRAFT_MODEL.get(preset)


def main(args: list[str]) -> int:
    if len(args) != 2 or args[0] not in PRESETS:
        print(f"usage: python -m harness.models.scale <{'|'.join(PRESETS)}> <dir>", file=sys.stderr)
        return 2
    build(args[0], Path(args[1]))
    print(f"wrote {args[0]} to {args[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from harness import blas
    from harness.faults import guarded

    blas.select()  # before mlx loads: see harness/blas.py
    sys.exit(guarded(lambda: main(sys.argv[1:]), "python -m harness.models.scale"))
