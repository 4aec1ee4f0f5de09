"""Resolving and loading target checkpoints, offline, through `mlx_lm.load`.

`arch.model` is either `fixture:<name>` (built on first use, see harness/fixtures.py),
`scale:<preset>` (a random ~1B checkpoint built on first use, harness/scale.py), or a
local directory: a checkpoint dir with config.json + *.safetensors + tokenizer
files, or a Hugging Face cache repo dir (models--org--name), whose newest snapshot
is used. Nothing is fetched from a hub: a missing path is an error, never a download.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.config import ConfigError
from harness import fixtures

# Never let a library reach for the network: the harness runs from local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def resolve_model(spec: str) -> Path:
    """The checkpoint directory `spec` names; raises ConfigError naming the fix."""
    if spec.startswith("fixture:"):
        name = spec.split(":", 1)[1]
        if fixtures.original(name)[0] not in fixtures.FIXTURES:
            raise ConfigError(f"unknown fixture {name!r} in arch.model; available: "
                              f"{', '.join('fixture:' + n for n in fixtures.fixture_names())} "
                              f"(each also quantized: fixture:<name>-q4, fixture:<name>-q8)")
        return fixtures.fixture_dir(name)
    if spec.startswith("scale:"):
        from harness import scale

        try:
            return scale.checkpoint_dir(spec.split(":", 1)[1])
        except KeyError as e:
            raise ConfigError(f"arch.model={spec}: {e.args[0]}") from None
    path = Path(spec).expanduser()
    fix = "set arch.model to a local checkpoint directory (config.json, *.safetensors, tokenizer files)"
    if not path.exists():
        raise ConfigError(f"model directory {path} does not exist; {fix}")
    if not path.is_dir():
        raise ConfigError(f"arch.model={path} is a file, not a directory; {fix}")
    snapshots = path / "snapshots"
    if not (path / "config.json").exists() and snapshots.is_dir():
        candidates = sorted((p for p in snapshots.iterdir() if (p / "config.json").exists()),
                            key=lambda p: p.stat().st_mtime)
        if candidates:
            path = candidates[-1]
    if not (path / "config.json").exists():
        raise ConfigError(f"{path} has no config.json, so it is not a checkpoint directory; {fix}")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"{path} has no *.safetensors weights; {fix}")
    return path


_LOADED: dict[tuple[str, str], tuple] = {}


def load_target(spec: str, dtype: str):
    """(model, tokenizer, checkpoint dir) for `spec` in `dtype`; cached per process so a
    sweep loads each checkpoint once."""
    import mlx.core as mx
    import mlx_lm

    key = (spec, dtype)
    if key not in _LOADED:
        path = resolve_model(spec)
        _LOADED.clear()  # keep one model resident: sweeps run arch by arch
        model, tokenizer = mlx_lm.load(str(path))
        if dtype != "native":
            cast_model(model, getattr(mx, dtype))
        _LOADED[key] = (model, tokenizer, path)
    return _LOADED[key]


def cast_model(model, dtype) -> None:
    """Cast floating parameters to `dtype`, except those the model keeps in its own
    precision (mlx-lm's cast_predicate, e.g. Qwen3.5's A_log), as mlx-lm's convert does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    keep = getattr(model, "cast_predicate", lambda _: True)
    params = [(k, v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


def has_moe(model) -> bool:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

    return any(isinstance(m, (SwitchGLU, SwitchLinear)) for _, m in model.named_modules())


def model_dtype(model) -> str:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    dtypes = {str(p.dtype).split(".")[-1] for _, p in tree_flatten(model.parameters())
              if mx.issubdtype(p.dtype, mx.floating)}
    return "+".join(sorted(dtypes))


def weight_bytes(model) -> dict:
    """Bytes of the model's parameters and the dtype holding most of them."""
    from mlx.utils import tree_flatten

    by_dtype: dict[str, int] = {}
    for _, p in tree_flatten(model.parameters()):
        key = str(p.dtype).split(".")[-1]
        by_dtype[key] = by_dtype.get(key, 0) + p.nbytes
    return {"bytes": sum(by_dtype.values()), "dtype": max(by_dtype, key=by_dtype.get)}
