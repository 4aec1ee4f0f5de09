"""Drafter checkpoint files: config.json + *.safetensors, read and written in one place."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from engines.base import DrafterError


def read_config(path: Path, what: str) -> dict:
    """config.json of the drafter directory `path`; DrafterError if absent or malformed."""
    if not (path / "config.json").is_file():
        raise DrafterError(f"{path} has no config.json: not {what} directory")
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise DrafterError(f"{path / 'config.json'} is not valid JSON ({e.msg})") from None


def read_tensors(path: Path, rename=lambda k: k) -> dict[str, mx.array]:
    """Every tensor of every *.safetensors in `path`, keys passed through `rename`."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({rename(k): v for k, v in mx.load(str(f)).items()})
    return out


def check_tensors(weights: dict, expected: dict[str, tuple], what: str, path: Path) -> None:
    """Every expected tensor present with its shape, or DrafterError naming the first that is not."""
    for name, shape in expected.items():
        if name not in weights:
            raise DrafterError(f"{what} tensor {name} is missing from {path}")
        if tuple(weights[name].shape) != tuple(shape):
            raise DrafterError(f"{what} tensor {name} has shape {tuple(weights[name].shape)}, config says "
                               f"{tuple(shape)}")


def write_checkpoint(path: Path, config: dict, weights: dict[str, mx.array], dtype=mx.bfloat16) -> None:
    """config.json + model.safetensors, floating tensors cast to `dtype`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
