"""Shared fixtures: the embedded fixture models, loaded once per test session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Harness subprocesses keep the wheel's BLAS, as this process does: no test depends on which
# BLAS serves it (optimized ones round verify rows differently from single-token decode).
os.environ.setdefault("SPEC_HARNESS_BLAS", "reference")
# The suite's harness runs take turns on a device lock of their own, never the host's: a user's
# benchmark holding the real lock must not stall the tests (nor the tests time the user's cells).
if "SPEC_HARNESS_LOCK_DIR" not in os.environ:
    import tempfile

    os.environ["SPEC_HARNESS_LOCK_DIR"] = tempfile.mkdtemp(prefix="spec-harness-test-locks-")

from harness.models.fixtures import fixture_dir, fixture_names  # noqa: E402

ARCHS = fixture_names()  # gemma4, gemma4_moe, llama, qwen35
REPO = Path(__file__).resolve().parent.parent


# Modules whose tests `python -m pytest -m cuda` selects (pyproject's marker): losslessness of every
# engine and rollback, and the CUDA kernels' own tests. Engines take the device's dispatch defaults
# (engines/runtime/dispatch.py), so on the GPU machine these run the CUDA-only paths.
CUDA_MODULES = {"test_lossless", "test_dflash", "test_eagle3", "test_mtp", "test_rollback", "test_quantized",
                "test_sampling", "test_gemm", "test_deltanet_cuda", "test_dispatch", "test_first_token",
                "test_round_accounting"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in CUDA_MODULES:
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session")
def models():
    """name -> (model, tokenizer), loaded through mlx_lm.load like a real checkpoint and
    cast to float32, where verify must match single-token decode exactly."""
    import mlx.core as mx
    import mlx_lm

    from harness.models.fixtures import cast_model

    out = {}
    for name in ARCHS:
        model, tok = mlx_lm.load(str(fixture_dir(name)))
        cast_model(model, mx.float32)
        out[name] = (model, tok)
    return out


def engine_cfg(**fields):
    """A method config as engines get it (harness/config.MethodConfig), with `fields` set."""
    from harness.config import MethodConfig

    return MethodConfig(**fields)


def method_cfg(block_size: int = 4, min_ngram: int = 1, max_ngram: int = 3):
    return engine_cfg(name="ngram", block_size=block_size, min_ngram=min_ngram, max_ngram=max_ngram)


def builtin_prompts():
    from harness.prompts import load_suite

    return load_suite("builtin")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a `python -m ...` child: this repo first on PYTHONPATH, ahead of what the
    parent had there (the GPU machine's MLX, hydra and mlx-lm live on PYTHONPATH, not in site-packages)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
