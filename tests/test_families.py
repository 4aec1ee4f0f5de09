"""Any mlx-lm family as a target: tiny checkpoints of each, written in the layout users have
and loaded through mlx_lm.load, run base, n-gram and DFlash Option A losslessly (float32)."""

import importlib
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten

from engines.drafters.dflash import DFlashConfig, DFlashDrafter, save_drafter
from engines.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3
from engines.methods.dflash import DFlashA
from engines.methods.eagle3 import Eagle3
from engines.methods.ngram import Ngram
from engines.runtime.hidden import decoder, hidden_size, num_layers
from engines.runtime.target import Target
from harness.models import fixtures
from harness.models.fixtures import cast_model
from tests.conftest import engine_cfg, method_cfg
from tests.helpers import base_engine, generate_ids
from tests.test_cli import REPO, records

COMMON = {"vocab_size": fixtures.VOCAB_SIZE, "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
          "tie_word_embeddings": False, "rope_theta": 10000.0}
FAMILIES = {
    "llama": {"model_type": "llama", "head_dim": 16},
    "mistral": {"model_type": "mistral", "head_dim": 16},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "moe_intermediate_size": 32, "norm_topk_prob": True},
    "qwen3_5": {"model_type": "qwen3_5", "head_dim": 16, "full_attention_interval": 2, "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "linear_conv_kernel_dim": 4},
    "qwen3_next": {"model_type": "qwen3_next", "head_dim": 16, "full_attention_interval": 2,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4,
                   "num_experts_per_tok": 2, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 64,
                   "mlp_only_layers": [], "moe_intermediate_size": 32, "partial_rotary_factor": 0.25},
    "gemma4_text": {"model_type": "gemma4_text", "head_dim": 16, "global_head_dim": 32, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"] * 2, "num_kv_shared_layers": 0,
                    "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0},
}


def _module(model_type: str):
    from mlx_lm.utils import MODEL_REMAPPING

    return importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")


def _build(family: str, dest):
    """A seeded random checkpoint of `family` in the on-disk layout mlx_lm.load reads."""
    from mlx_lm.utils import save_config

    config = {**COMMON, **FAMILIES.get(family, {})}
    wrapper = family == "gemma4"  # Gemma4ForConditionalGeneration: the text model nested as language_model
    if wrapper:
        text = {**COMMON, **FAMILIES["gemma4_text"], "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
                "vocab_size_per_layer_input": fixtures.VOCAB_SIZE}  # as Gemma 4 E2B/E4B: KV sharing, per-layer inputs
        config = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
                  "vocab_size": fixtures.VOCAB_SIZE, "text_config": text}
    module = _module(config["model_type"])
    mx.random.seed(7)
    model = module.Model(module.ModelArgs.from_dict(dict(config)))
    weights = dict(tree_flatten(model.parameters()))
    if wrapper:  # as the original checkpoint names them: model.language_model.*
        weights = {k.replace("language_model.model.", "model.language_model.", 1): v for k, v in weights.items()}
    dest.mkdir(parents=True)
    fixtures.write_tokenizer(dest)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_config(config, dest / "config.json")
    return dest


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: _build(f, root / f) for f in [*FAMILIES, "gemma4"]}


def _random_dflash(model, dest):
    n, h = num_layers(model), hidden_size(model)
    spec = {"hidden_size": h, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "block_size": 4, "vocab_size": fixtures.VOCAB_SIZE, "num_target_layers": n,
            "dflash_config": {"target_layer_ids": [0, n - 1], "mask_token_id": fixtures.MASK_TOKEN_ID}}
    mx.random.seed(3)
    save_drafter(DFlashDrafter(DFlashConfig.from_json(spec, "spec")), dest, dtype=mx.float32)
    return dest


@pytest.mark.parametrize("family", [*FAMILIES, "gemma4"])
def test_every_family_runs_base_ngram_and_dflash_losslessly(family_dirs, tmp_path, family):
    model, tok = mlx_lm.load(str(family_dirs[family]))
    cast_model(model, mx.float32)
    assert isinstance(decoder(model).layers, list)
    drafter = _random_dflash(model, tmp_path / "dflash")
    engines = [Ngram(Target(model), method_cfg(block_size=3)),
               DFlashA.build(model, engine_cfg(block_size=None, drafter=str(drafter), verify="batched"))]
    prompt = tok.encode("one two three, one two three, one two")
    want = generate_ids(base_engine(model), prompt, 20).tokens
    for eng in engines:
        assert generate_ids(eng, prompt, 20).tokens == want, f"{family} {eng.name}"


def test_gemma4_original_checkpoint_runs_eagle3_and_refuses_q8_kv_in_a_record(family_dirs, tmp_path):
    path = family_dirs["gemma4"]
    model, tok = mlx_lm.load(str(path))
    cast_model(model, mx.float32)
    c = Eagle3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                     rms_norm_eps=1e-6, max_position_embeddings=2048, vocab_size=fixtures.VOCAB_SIZE,
                     draft_vocab_size=fixtures.VOCAB_SIZE, target_hidden_size=64, head_dim=16,
                     layer_types=("full_attention",), aux_layer_ids=(1, 2, 3))
    mx.random.seed(4)
    save_eagle3(Eagle3Drafter(c), tmp_path / "eagle3", dtype=mx.float32)
    eng = Eagle3.build(model, engine_cfg(drafter=str(tmp_path / "eagle3"), verify="batched", depth=3, top_k=2,
                                                total_tokens=6))
    prompt = tok.encode("one two three, one two three, one two")
    assert generate_ids(eng, prompt, 20).tokens == generate_ids(base_engine(model), prompt, 20).tokens
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "harness", "arch=gemma4", f"arch.model={path}", "kv=q8", "bench=smoke",
                        "bench.max_prompts=1", f"out_dir={out}"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 4, r.stderr  # a single unsupported cell (docs/exit-codes.md)
    (rec,) = records(out).values()
    assert rec["status"] == "unsupported" and "share KV" in rec["reason"]
