"""Quantize a drafter directory's linear weights the way mlx-lm quantizes targets.

`python -m train.quantize SRC DEST [--bits 8] [--group-size 64]` packs every 2-D floating
`*.weight` whose input width the group size divides (the linear layers: norms are 1-D, d2t /
t2d are integers) into uint32 with scales and biases, and records `quantization` in
config.json; the harness's drafter loaders read the result strictly (engines/runtime/checkpoint.py
quantize_like). Anything else is copied unchanged. `--dequantize` writes the floating copy of
a quantized drafter (its weights as the quantized form decodes them, in --dtype): what a
backend that compiles its quantized matmuls per shape runs instead (MLX's CUDA JIT).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx


def quantize_drafter(src: Path, dest: Path, bits: int = 8, group_size: int = 64) -> dict:
    """Write the quantized copy of drafter `src` to `dest`; returns {packed, kept} tensor counts."""
    src, dest = Path(src), Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    counts = {"packed": 0, "kept": 0}
    for f in sorted(src.glob("*.safetensors")):
        out = {}
        for k, v in mx.load(str(f)).items():
            if k.endswith(".weight") and v.ndim == 2 and mx.issubdtype(v.dtype, mx.floating) and v.shape[1] % group_size == 0:
                w, scales, biases = mx.quantize(v, group_size=group_size, bits=bits)
                out[k], out[k[: -len("weight")] + "scales"], out[k[: -len("weight")] + "biases"] = w, scales, biases
                counts["packed"] += 1
            else:
                out[k] = v
                counts["kept"] += 1
        mx.save_safetensors(str(tmp / f.name), out, metadata={"format": "mlx"})
    for f in src.iterdir():  # the training record and curves travel with the weights
        if f.is_file() and f.suffix not in (".safetensors",) and f.name != "config.json":
            shutil.copyfile(f, tmp / f.name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return counts


def dequantize_drafter(src: Path, dest: Path, dtype=mx.bfloat16) -> dict:
    """Write the floating copy of quantized drafter `src` to `dest` (each packed weight as
    mx.dequantize gives it, cast to `dtype`); returns {unpacked, kept} tensor counts."""
    src, dest = Path(src), Path(dest)
    config = json.loads((src / "config.json").read_text())
    q = config.pop("quantization", None)
    if q is None:
        raise SystemExit(f"{src}: config.json has no quantization: it is not a quantized drafter")
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    counts = {"unpacked": 0, "kept": 0}
    for f in sorted(src.glob("*.safetensors")):
        weights, out = mx.load(str(f)), {}
        for k, v in weights.items():
            base = k[: -len("scales")] if k.endswith(".scales") else None
            if base is not None and base + "weight" in weights:
                out[base + "weight"] = mx.dequantize(weights[base + "weight"], v, weights.get(base + "biases"),
                                                     group_size=q["group_size"], bits=q["bits"]).astype(dtype)
                counts["unpacked"] += 1
            elif not (k.endswith(".biases") and k[: -len("biases")] + "scales" in weights) and \
                    not (k.endswith(".weight") and k[: -len("weight")] + "scales" in weights):
                out[k] = v
                counts["kept"] += 1
        mx.save_safetensors(str(tmp / f.name), out, metadata={"format": "mlx"})
    for f in src.iterdir():
        if f.is_file() and f.suffix not in (".safetensors",) and f.name != "config.json":
            shutil.copyfile(f, tmp / f.name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dest", type=Path)
    ap.add_argument("--bits", type=int, default=8, choices=(2, 3, 4, 5, 6, 8))
    ap.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    ap.add_argument("--dequantize", action="store_true", help="write the floating copy of a quantized drafter")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    a = ap.parse_args()
    if not (a.src / "config.json").is_file():
        from harness.errors import ConfigError

        raise ConfigError(f"{a.src} is not a drafter folder (no config.json); pass the folder python -m train exported")
    if a.dequantize:
        print(dequantize_drafter(a.src, a.dest, getattr(mx, a.dtype)))
    else:
        print(quantize_drafter(a.src, a.dest, a.bits, a.group_size))


if __name__ == "__main__":
    from harness.faults import guarded

    sys.exit(guarded(main, "python -m train.quantize"))
