"""Random-weight checkpoints at realistic sizes, built locally (nothing is downloaded).

`python -m harness.scale <preset> <dir>` writes a checkpoint directory (config.json,
bf16 model.safetensors, the fixture tokenizer) for an mlx-lm architecture at about
1B parameters. Its outputs are meaningless, so acceptance is near zero, but the cost
of a decode step, of verifying K+1 tokens, and of rolling back are those of a model
that size: use it with `method=control` (or any method) to measure verify cost curves
on a machine where no real checkpoint is at hand, e.g.

    python -m harness.scale qwen35-1b /tmp/qwen35-1b
    python -m harness arch=qwen35 arch.model=/tmp/qwen35-1b arch.dtype=native method=control method.block_size=16
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from harness import fixtures

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
}


def build(preset: str, dest: Path) -> None:
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from harness.models import cast_model

    spec = PRESETS[preset]
    module = importlib.import_module(f"mlx_lm.models.{spec['model_type']}")
    mx.random.seed(fixtures.SEED)
    model = module.Model(module.ModelArgs.from_dict(dict(spec)))
    cast_model(model, mx.bfloat16)
    dest.mkdir(parents=True, exist_ok=True)
    fixtures.write_tokenizer(dest)  # ids < 1024 only: a subset of the model's vocabulary
    save_model(dest, model)
    save_config(dict(spec), dest / "config.json")


def main(args: list[str]) -> int:
    if len(args) != 2 or args[0] not in PRESETS:
        print(f"usage: python -m harness.scale <{'|'.join(PRESETS)}> <dir>", file=sys.stderr)
        return 2
    build(args[0], Path(args[1]))
    print(f"wrote {args[0]} to {args[1]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
