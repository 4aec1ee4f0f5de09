"""Quantized targets (mlx-lm's 4-bit and 8-bit conversions): sizes and dtype come from the
model, never from packed weights; every drafter loads onto them unchanged and stays lossless."""


import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from engines.drafters.dflash import load_drafter
from engines.drafters.eagle3 import load_eagle3
from engines.drafters.mtp import load_mtp
from engines.methods.dflash import DFlashA
from engines.methods.eagle3 import Eagle3
from engines.methods.mtp import MTP
from engines.runtime.hidden import activation_dtype, hidden_size, vocab_size
from harness.models import fixtures
from harness.models.fixtures import cast_model
from tests.conftest import engine_cfg
from tests.helpers import base_tokens, generate_ids
from tests.test_cli import QUICK, harness, records
from tests.test_lossless import _units


@pytest.fixture(scope="module")
def quantized():
    out = {}
    for name in ("llama-q4", "qwen35-q4", "qwen35-q8"):
        model, tok = mlx_lm.load(str(fixtures.fixture_dir(name)))
        cast_model(model, mx.float32)
        out[name] = (model, tok)
    return out


def _params(module) -> dict:
    return dict(tree_flatten(module.parameters()))


def _same(a, b) -> bool:
    pa, pb = _params(a), _params(b)
    return pa.keys() == pb.keys() and all(pa[k].dtype == pb[k].dtype and mx.array_equal(pa[k], pb[k]).item() for k in pa)


def test_sizes_and_dtype_come_from_the_model_not_the_packed_weights(quantized, models):
    q, full = quantized["llama-q4"][0], models["llama"][0]
    assert q.model.embed_tokens.weight.dtype == mx.uint32 and q.model.embed_tokens.weight.shape[-1] != 128
    assert (hidden_size(q), vocab_size(q), activation_dtype(q)) == (hidden_size(full), vocab_size(full), mx.float32)


@pytest.mark.parametrize("name", ["llama-q4", "qwen35-q4", "qwen35-q8"])
def test_drafters_load_bit_identical_onto_the_quantized_target(quantized, models, name):
    q = quantized[name][0]
    base = fixtures.original(name)[0]
    full = models[base][0]
    assert _same(load_drafter(fixtures.drafter_dir("dflash", name), q), load_drafter(fixtures.drafter_dir("dflash", base), full))
    assert _same(load_eagle3(fixtures.drafter_dir("eagle3", name), q), load_eagle3(fixtures.drafter_dir("eagle3", base), full))
    if base == "qwen35":  # the MTP head from the original checkpoint, next to the quantized target
        head = load_mtp(fixtures.fixture_dir(base), q)
        assert _same(head, load_mtp(fixtures.fixture_dir(base), full))
        assert all(v.dtype == mx.float32 for v in _params(head).values() if mx.issubdtype(v.dtype, mx.floating))


def test_every_drafting_engine_is_lossless_on_a_4bit_target(quantized):
    for name, engines in (("llama-q4", ("dflash", "eagle3")), ("qwen35-q4", ("dflash", "eagle3", "mtp"))):
        model, tok = quantized[name]
        base = fixtures.original(name)[0]
        made = {"dflash": lambda: DFlashA.build(model, engine_cfg(
                    block_size=None, drafter=str(fixtures.drafter_dir("dflash", name)), verify="batched")),
                "eagle3": lambda: Eagle3.build(model, engine_cfg(
                    drafter=str(fixtures.drafter_dir("eagle3", name)), verify="batched", depth=3, top_k=3,
                    total_tokens=8)),
                "mtp": lambda: MTP.build(model, engine_cfg(
                    drafter=str(fixtures.fixture_dir(base)), block_size=3, verify="batched"))}
        for kind in engines:
            eng = made[kind]()
            for _, ids in list(_units(tok))[:3]:
                got = generate_ids(eng, ids, 32)
                assert got.tokens == base_tokens(model, ids, 32), f"{name} {kind}"


def test_a_4bit_target_runs_every_method_to_ok_records_without_divergence(tmp_path):
    out = tmp_path / "q4"
    r = harness("-m", "arch=qwen35", "arch.model=fixture:qwen35-q4", "method=base,ngram,dflash_a,eagle3,mtp",
                *QUICK, f"out_dir={out}")
    assert r.returncode == 0, r.stderr
    recs = records(out)
    assert {rec["cell"]["method"]["name"] for rec in recs.values()} == {"base", "ngram", "dflash_a", "eagle3", "mtp"}
    for rec in recs.values():
        assert rec["status"] == "ok", rec.get("reason")
        assert rec["summary"]["diverged_prompts"] == 0
        assert rec["model"]["dtype"] == "float32"  # the scales, cast; the packed weights stay uint32
        assert rec["model"]["quantization"]["bits"] == 4 and rec["model"]["quantization"]["group_size"] == 64
