"""Draft models that ship without the tensors they share with their target.

A draft language model distilled from its target keeps the target's token embedding (its
largest tensor: 28M of SmolLM2-135M's parameters) frozen, so shipping it again would only
copy the target. Such a checkpoint lists the shared tensors in `shared_with_target.json`,
each with its shape and a fingerprint (a few rows, as float32, taken when it was trained),
and its model.safetensors lacks them. `materialize` builds the whole checkpoint once per
target, in the harness cache: the target's tensor, checked against the fingerprint, beside
the draft's own. What it writes is a plain mlx-lm checkpoint that any loader reads
strictly (mlx-lm's `--draft-model` too). A target whose tensor differs from the
fingerprint (another model, another vocabulary) is refused in one line: a draft model
assembled from another target's embedding would load and draft nonsense.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engines.errors import DrafterError

MANIFEST = "shared_with_target.json"
FINGERPRINT_ROWS = 16  # rows of each shared tensor kept, spread over its first axis
TOLERANCE = 0.02  # relative L2 distance allowed per row: bf16 rounding or re-quantization, not another model


def shares_tensors(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def fingerprint(weight: mx.array) -> dict:
    """The shape and FINGERPRINT_ROWS rows (float32) of a tensor, for the manifest."""
    rows = sorted({round(i * (weight.shape[0] - 1) / (FINGERPRINT_ROWS - 1)) for i in range(FINGERPRINT_ROWS)})
    return {"shape": list(weight.shape), "rows": rows, "values": weight[mx.array(rows)].astype(mx.float32).tolist()}


def write_manifest(out: Path, shared: dict[str, mx.array]) -> None:
    """Names the tensors `out` leaves to its target, each with its fingerprint."""
    body = {"note": "tensors taken from the target at load (engines/runtime/shared_weights.py)",
            "tensors": {name: fingerprint(w) for name, w in shared.items()}}
    (Path(out) / MANIFEST).write_text(json.dumps(body))


def target_tensor(model: nn.Module, name: str) -> mx.array:
    """The target's parameter `name`, dequantized when the target is quantized."""
    params = dict(tree_flatten(model.parameters()))
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    if name not in params:
        raise DrafterError(f"the target has no tensor {name} to share with its draft model")
    w = params[name]
    if f"{base}.scales" in params:
        module = dict(model.named_modules())[base]
        w = mx.dequantize(w, params[f"{base}.scales"], params.get(f"{base}.biases"), module.group_size, module.bits,
                          mode=getattr(module, "mode", "affine"))
    return w


def check(name: str, w: mx.array, fp: dict, path: Path) -> None:
    """DrafterError unless `w` matches fingerprint `fp` (shape, and every kept row within TOLERANCE)."""
    if list(w.shape) != fp["shape"]:
        raise DrafterError(f"{path}: the target's {name} is {list(w.shape)}, the draft model was trained with "
                           f"{fp['shape']}: it was distilled from another target")
    mine = w[mx.array(fp["rows"])].astype(mx.float32)
    ref = mx.array(fp["values"], dtype=mx.float32)
    dist = (mx.linalg.norm(mine - ref, axis=-1) / mx.maximum(mx.linalg.norm(ref, axis=-1), 1e-12)).max().item()
    if dist > TOLERANCE:
        raise DrafterError(f"{path}: the target's {name} differs from the one the draft model was trained with "
                           f"(relative distance {dist:.3f} > {TOLERANCE}): it was distilled from another target")


def materialize(path: Path, model: nn.Module, cache_root: Path) -> Path:
    """The whole checkpoint of draft model `path` with its shared tensors taken from the target
    `model`, written once under cache_root (keyed by the draft's files and the target tensors)."""
    path = Path(path)
    shared = json.loads((path / MANIFEST).read_text())["tensors"]
    tensors = {}
    for name, fp in shared.items():
        tensors[name] = target_tensor(model, name)
        check(name, tensors[name], fp, path)
    key = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        key.update(f.name.encode() + f.read_bytes())
    for name in sorted(tensors):
        key.update(name.encode() + str(tensors[name].dtype).encode())
        key.update(bytes(memoryview(tensors[name].astype(mx.float32))))
    dest = Path(cache_root) / "drafters" / f"{path.name}-{key.hexdigest()[:12]}"
    if (dest / "config.json").is_file():
        return dest
    own = mx.load(str(path / "model.safetensors"))
    if clash := sorted(set(own) & set(tensors)):
        raise DrafterError(f"{path}: {', '.join(clash)} is both in model.safetensors and in {MANIFEST}")
    config = json.loads((path / "config.json").read_text())
    if "quantization" in config:  # the draft's own layers stay quantized; the shared tensors come in as they are
        config["quantization"] = {**config["quantization"], **{n[: -len(".weight")]: False for n in tensors}}
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in path.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", MANIFEST, "config.json"):
            shutil.copyfile(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(tmp / "model.safetensors"), {**own, **tensors}, metadata={"format": "mlx"})
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest
