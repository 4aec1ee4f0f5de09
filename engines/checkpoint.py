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
    """Every tensor of every *.safetensors in `path` (or, where there are none, of a torch
    `pytorch_model.bin`, read without torch or pickle code), keys passed through `rename`."""
    files = sorted(path.glob("*.safetensors"))
    if not files and (path / "pytorch_model.bin").is_file():
        from engines.torch_bin import read_torch_bin

        return {rename(k): v for k, v in read_torch_bin(path / "pytorch_model.bin").items()}
    if not files:
        raise DrafterError(f"{path} has no *.safetensors and no pytorch_model.bin: no weights to load")
    out = {}
    for f in files:
        out.update({rename(k): v for k, v in mx.load(str(f)).items()})
    return out


def refuse_unknown(names, known, what: str, where, fix: str) -> None:
    """DrafterError naming every entry of `names` outside `known`: a checkpoint part this code
    would silently drop changes what the drafter computes, so it is refused, never ignored."""
    extra = sorted(set(names) - set(known))
    if extra:
        shown = ", ".join(extra[:6]) + (f" (+{len(extra) - 6} more)" if len(extra) > 6 else "")
        raise DrafterError(f"{where}: {what} {shown} not implemented by this loader; {fix}")


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict for mlx-lm's initialize_rope) from a transformers v4 config
    (rope_theta + rope_scaling) or a v5 one (rope_parameters, possibly one per layer type)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & set(params):
        params = params.get("sliding_attention") or params.get("full_attention")  # as speculators collapses it
    scaling = params or cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = (scaling or {}).get("rope_theta", 10000.0)
    return float(theta), scaling


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


def qwen3_layer_types(cfg: dict, n: int) -> list[str]:
    """transformers' Qwen2/Qwen3 rule where a config has no layer_types: with use_sliding_window,
    the layers from max_window_layers on slide; otherwise none does."""
    if not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        return ["full_attention"] * n
    first = cfg.get("max_window_layers", 28)
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
