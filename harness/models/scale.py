"""Random-weight checkpoints at realistic sizes, built locally (nothing is downloaded).

`python -m harness.models.scale <preset> <dir>` writes a checkpoint directory (config.json,
bf16 model.safetensors, the fixture tokenizer) for an mlx-lm architecture at about
1B parameters, and beside it `<dir>-dflash`, a random 2-layer DFlash drafter for it
(z-lab layout, block 8). Outputs are meaningless, so acceptance is near zero (tau 1.0):
what such a pair measures is pure cost -- a decode step, a verify of K+1 tokens, a
rollback, a drafting round -- at the size of a real model, on a machine where no real
checkpoint is at hand, e.g.

    python -m harness.models.scale qwen35-1b /tmp/qwen35-1b
    python -m harness arch=qwen35 arch.model=/tmp/qwen35-1b arch.dtype=native method=control method.block_size=16

`arch.model=scale:<preset>` (and `method.drafter=scale:<preset>`) builds them on first
use under SPEC_HARNESS_HOME, as the fixtures are; conf/gate/gpu.yaml runs on those.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

from engines.home import home
from harness.models import fixtures

PRESETS = {
    "llama-1b": {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 500000.0,
                 "vocab_size": 32000, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                 "max_position_embeddings": 8192},
    "qwen35-1b": {"model_type": "qwen3_5", "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 6144,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "full_attention_interval": 4,
                  "linear_num_value_heads": 16, "linear_num_key_heads": 16, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 32000,
                  "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "max_position_embeddings": 8192,
                  "rope_parameters": {"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}},
    # The same layout at toy size, so tests can build and run a preset in seconds.
    "llama-tiny": {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4, "intermediate_size": 256,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 500000.0,
                   "vocab_size": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                   "max_position_embeddings": 8192},
}


def build(preset: str, dest: Path) -> None:
    """The target checkpoint of `preset` in `dest`, and its random DFlash drafter in `<dest>-dflash`."""
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
    build_dflash(preset, dflash_dir(dest))


def dflash_dir(target_dir: Path) -> Path:
    return target_dir.with_name(target_dir.name + "-dflash")


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


def build_dflash(preset: str, dest: Path) -> None:
    import mlx.core as mx

    from engines.dflash import DFlashConfig, DFlashDrafter, save_drafter  # MLX, mlx-lm: a spec resolves without

    mx.random.seed(fixtures.SEED + 1)
    spec = dflash_spec(preset)
    save_drafter(DFlashDrafter(DFlashConfig.from_json(spec, f"dflash_spec({preset})")), dest)


def _stale(dest: Path) -> bool:
    # A build from before the fixture tokenizer was retrained (e.g. on the held-out corpus)
    # would tokenize prompts differently from a fresh one: rebuild it.
    built = dest / "tokenizer.json"
    return not built.is_file() or built.read_bytes() != (fixtures.SHIPPED_DIR / "tokenizer.json").read_bytes()


def checkpoint_dir(preset: str) -> Path:
    """`scale:<preset>`: the checkpoint built on first use under SPEC_HARNESS_HOME (2 GB each)."""
    if preset not in PRESETS:
        raise KeyError(f"unknown scale preset {preset!r}; available: {', '.join(sorted(PRESETS))}")
    dest = home() / "scale" / preset
    if not (dest / "config.json").exists() or not (dflash_dir(dest) / "config.json").exists() or _stale(dest):
        tmp = dest.with_name(f".{preset}.building")
        build(preset, tmp)
        for d, final in ((dflash_dir(tmp), dflash_dir(dest)), (tmp, dest)):
            if final.exists():
                shutil.rmtree(final)
            d.rename(final)
    return dest


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
