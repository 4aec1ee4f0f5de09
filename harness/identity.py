"""What a record measured beyond its config: the content of every input, and the code that ran.

A cell's id (harness/records.cell_id) names its config, so a rerun finds its record. The
record's `inputs` name what that config read, by content: the prompt suite's files, the
context source, the target's and the drafters' weights (sha256), and the code that measured
it (a hash of the harness's and the engines' source, with the MLX and mlx-lm versions). A
record is reused only when its inputs are this run's; one made by other code only when the
user asks for it (reuse_other_code=true). `stale` says, in words, what changed.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CODE_DIRS = ("harness", "engines")  # what measures; report/ and train/ only read or make inputs
WEIGHT_FILES = ("config.json", "*.safetensors")  # what a checkpoint's numbers come from


@lru_cache(maxsize=1)
def code_fingerprint() -> dict:
    """sha256 over the harness's and engines' Python source (relative path and bytes, sorted),
    with the versions of the libraries that run the models."""
    h = hashlib.sha256()
    for path in sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*.py")):
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"source_sha256": h.hexdigest(), "mlx": _version("mlx"), "mlx_lm": _version("mlx-lm")}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def weights_sha256(directory) -> str:
    """One sha256 over a checkpoint directory's config and weight files (each hashed once per
    path, size and mtime: harness/models/gguf_import.file_sha256 remembers them)."""
    from harness.models.gguf_import import file_sha256

    d = Path(directory)
    files = sorted({p for pattern in WEIGHT_FILES for p in d.glob(pattern) if p.is_file()})
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_sha256(p)}\0".encode())
    return h.hexdigest()


def file_sha256(path) -> str:
    from harness.models.gguf_import import file_sha256 as remembered

    return remembered(Path(path))


def cell_inputs(suite: list[dict], target, drafters: dict, context_source: Path | None) -> dict:
    """The record's `inputs`: `suite` as harness.prompts.suite_sources gives it, the target's
    checkpoint directory, {arm: drafter directory or None}, the context file (bench.context > 0)."""
    inputs = {"suite": {s["spec"]: s["sha256"] for s in suite}, "target": weights_sha256(target)}
    for arm, path in drafters.items():
        if path is not None:
            inputs[f"drafter:{arm}"] = weights_sha256(path)
    if context_source is not None:
        inputs["context_source"] = file_sha256(context_source)
    inputs["code"] = code_fingerprint()
    return inputs


def stale(recorded: dict | None, now: dict, reuse_other_code: bool) -> str | None:
    """Why a record with `recorded` inputs does not measure this run's `now`, in words; None when
    it does. Inputs are compared by content; the code too, unless `reuse_other_code`."""
    if not isinstance(recorded, dict):
        return ("it names none of its inputs (made before records did); reuse_other_code=true reuses it"
                if not reuse_other_code else None)
    changed = [_changed(key, recorded.get(key), now.get(key)) for key in sorted(set(now) | set(recorded))
               if key != "code" and recorded.get(key) != now.get(key)]
    if changed:
        return "; ".join(changed)
    if reuse_other_code or recorded.get("code") == now.get("code"):
        return None
    return f"{_changed('code', recorded.get('code'), now.get('code'))} (reuse_other_code=true reuses it)"


def _changed(key: str, before, after) -> str:
    what = {"suite": "the prompt suite's content", "target": "the target's weights",
            "context_source": "the context source's content", "code": "it was measured by other code"}.get(
        key, f"the {key.split(':', 1)[-1]} arm's drafter weights" if key.startswith("drafter:") else key)
    if key == "code":
        return f"{what} ({_short(before, 'source_sha256')} -> {_short(after, 'source_sha256')})"
    if key == "suite" and isinstance(before, dict) and isinstance(after, dict):
        parts = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
        return f"{what} changed ({', '.join(f'{k}: {_hex(before.get(k))} -> {_hex(after.get(k))}' for k in parts)})"
    return f"{what} changed ({_hex(before)} -> {_hex(after)})"


def _short(code, key: str) -> str:
    if not isinstance(code, dict):
        return "unknown"
    libs = ", ".join(f"{k} {code.get(k)}" for k in ("mlx", "mlx_lm"))
    return f"source {_hex(code.get(key))}, {libs}"


def _hex(value) -> str:
    return value[:12] if isinstance(value, str) else "none"
