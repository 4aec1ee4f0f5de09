"""Checkpoint configs: strict about the model, not about bookkeeping, and typed.

Published layouts are built here with every field their real config.json has (tiny shapes)
and load; fields that transformers' and speculators' serialization write without meaning
anything for the weights pass; a mistyped, out-of-range or missing field is refused in one
line naming the file and the field; a config.json that is not JSON names the file, for
drafters (DrafterError) and targets (TargetError) alike."""

import json
import shutil

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from engines.drafters.dflash import load_drafter
from engines.drafters.eagle3 import load_eagle3
from engines.errors import DrafterError
from engines.methods.dflash import DFlashA
from engines.methods.eagle3 import Eagle3
from engines.runtime.checkpoint import BOOKKEEPING, INERT_DEFAULTS
from harness.errors import TargetError
from harness.models import fixtures
from harness.models.fixtures import cast_model
from harness.models.load import load_target
from tests.conftest import engine_cfg
from tests.helpers import base_tokens, generate_ids
from tests.test_layouts import _dflash_layer_shapes, _eagle_layer_shapes, _random, _write

H, V, HEADS, KV, HD, I = 128, 1024, 4, 2, 32, 256  # the llama fixture's widths
DRAFT_V = 512


@pytest.fixture(scope="module")
def target8():
    """A random 8-layer Llama in float32, built in-process: deep enough that EAGLE-3's default
    aux layers (2, 4, 5) are distinct, as they are on the 32-layer Llama-3.1-8B."""
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=H, num_hidden_layers=8, intermediate_size=I,
                                        num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD,
                                        rms_norm_eps=1e-5, vocab_size=V, rope_theta=500000.0,
                                        tie_word_embeddings=False))
    cast_model(model, mx.float32)
    return model


def _lossless(engine, model, n=20):
    ids = list(range(40, 80, 3)) + [7, 7, 9]
    got = generate_ids(engine, ids, n)
    assert got.tokens == base_tokens(model, ids, n)
    return got


def _d2t_t2d():
    keep = mx.array(sorted(range(0, V, 2)))  # the draft vocabulary: every other target id
    t2d = mx.zeros((V,), dtype=mx.bool_).at[keep].add(True)
    return (keep - mx.arange(DRAFT_V)).astype(mx.int64), t2d


def _eagle_tensors(seed, qwen3=False, layers=1, aux=3, draft=True, input_norm=False):
    shapes = {"embed_tokens.weight": (V, H), "fc.weight": (H, aux * H), "norm.weight": (H,),
              "lm_head.weight": (DRAFT_V if draft else V, H)}
    for i in range(layers):
        shapes.update(_eagle_layer_shapes(i, qwen3))
    if input_norm:
        shapes["input_norm.weight"] = (aux * H,)
    tensors = _random(shapes, seed)
    if draft:
        tensors["d2t"], tensors["t2d"] = _d2t_t2d()
    return tensors


# ---------------------------------------------------------------- published layouts, every field

def redhat_llama31_8b_speculator_config() -> dict:
    """RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3's config.json (speculators 0.2.0.dev11),
    shrunk. Its fields down to speculators_version are as the published commit shows them
    (5b6cee4e, "Upload folder using huggingface_hub"); the rest (target_hidden_size, torch_dtype,
    the 19 transformer_layer_config fields, transformers_version) are the field list the same
    speculators serialization writes, as nm-testing/EAGLE3-LLaMA3.1-Instruct-8B-converted's
    config.json shows it: the published file's tail was not available to copy."""
    return {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
        "draft_vocab_size": DRAFT_V,
        "has_no_defaults_at_init": False,
        "norm_before_residual": True,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 5,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"],
                         "name_or_path": "/proving-grounds/machine/eldarkurtic/hf_downloads/meta-llama/"
                                         "Llama-3.1-8B-Instruct"}},
        "speculators_model_type": "eagle3",
        "speculators_version": "0.2.0.dev11",
        "target_hidden_size": None,
        "torch_dtype": "bfloat16",
        "transformer_layer_config": {
            "attention_bias": False, "attention_dropout": 0.0, "head_dim": HD, "hidden_act": "silu", "hidden_size": H,
            "initializer_range": 0.02, "intermediate_size": I, "max_position_embeddings": 131072, "mlp_bias": False,
            "model_type": "llama", "num_attention_heads": HEADS, "num_hidden_layers": 1, "num_key_value_heads": KV,
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
            "use_cache": True, "vocab_size": V},
        "transformers_version": "4.54.1",
    }


def speculators_draft_model_config() -> dict:
    """The newer speculators Eagle3DraftModel (0.5-0.7) with every field its configs carry:
    inference-optimization/Mistral3_speculator_dummy's (base_model_ep_plan, dtype,
    embed_requires_grad, ...) and a 0.7 one's layer fields (token ids, layer_types,
    rope_parameters), shrunk to 2 Qwen3-type layers on 4 aux features."""
    return {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "base_model_ep_plan": None, "draft_vocab_size": DRAFT_V, "dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5, 7], "embed_requires_grad": False,
        "has_no_defaults_at_init": False, "fc_norm": False, "norm_before_fc": True, "norm_before_residual": True,
        "norm_output": True,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": 3, "verifier_accept_k": 1}],
                               "verifier": {"architectures": [], "name_or_path": "some/target"}},
        "speculators_model_type": "eagle3", "speculators_version": "0.7.0.dev80", "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": {
            "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": HD,
            "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I,
            "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 32768, "mlp_bias": False,
            "model_type": "qwen3", "num_attention_heads": HEADS, "num_hidden_layers": 2, "num_key_value_heads": KV,
            "pad_token_id": None, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "use_cache": True,
            "vocab_size": V},
        "transformers_version": "4.57.1",
    }


def safeailab_config() -> dict:
    """SafeAILab's EAGLE-3 (e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge's llama3-8B-eagle3.json):
    a flat Llama config plus draft_vocab_size, every field it has."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
            "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": HEADS,
            "num_key_value_heads": KV, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
            "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
            "vocab_size": V, "draft_vocab_size": DRAFT_V}


def zlab_dflash_config() -> dict:
    """z-lab's DFlash (Qwen3 *-DFlash-b16 schema) with every field its config.json has."""
    return {"architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": 151643,
            "dflash_config": {"mask_token_id": fixtures.MASK_TOKEN_ID, "target_layer_ids": [1, 3, 5, 7]},
            "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": HD, "hidden_act": "silu", "hidden_size": H,
            "initializer_range": 0.02, "intermediate_size": I, "layer_types": ["full_attention"] * 2,
            "max_position_embeddings": 40960, "max_window_layers": 2, "model_type": "qwen3",
            "num_attention_heads": HEADS, "num_hidden_layers": 2, "num_key_value_heads": KV, "num_target_layers": 8,
            "pad_token_id": None, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
            "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.57.1", "use_cache": True,
            "use_sliding_window": False, "vocab_size": V}


def _eagle_cfg(path):
        return engine_cfg(drafter=str(path), verify="batched", depth=3, top_k=3, total_tokens=8)


def test_redhat_speculators_v02_eagle3_as_published_loads_and_stays_lossless(target8, tmp_path):
    # It was refused with "config field(s) has_no_defaults_at_init not implemented by this loader".
    path = _write(tmp_path / "redhat", redhat_llama31_8b_speculator_config(), _eagle_tensors(21))
    eng = Eagle3.build(target8, _eagle_cfg(path))
    c = eng.drafter.config
    assert c.layout == "speculators" and c.norm_before_residual and c.aux_layer_ids == (2, 4, 5)
    assert (c.draft_vocab_size, c.target_hidden_size, c.rope_theta) == (DRAFT_V, H, 500000.0)
    _lossless(eng, target8)


@pytest.mark.parametrize("layout", ["speculators_draft_model", "safeailab"])
def test_other_published_eagle3_layouts_with_every_field_load_and_stay_lossless(target8, tmp_path, layout):
    if layout == "speculators_draft_model":
        config, tensors = speculators_draft_model_config(), _eagle_tensors(22, qwen3=True, layers=2, aux=4,
                                                                           input_norm=True)
    else:
        config, tensors = safeailab_config(), _eagle_tensors(23)
        tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in tensors.items()}
    eng = Eagle3.build(target8, _eagle_cfg(_write(tmp_path / layout, config, tensors)))
    _lossless(eng, target8)


def test_zlab_dflash_with_every_field_loads_and_stays_lossless(target8, tmp_path):
    
    shapes = {"fc.weight": (H, 4 * H), "hidden_norm.weight": (H,), "norm.weight": (H,), **_dflash_layer_shapes(0),
              **_dflash_layer_shapes(1)}
    path = _write(tmp_path / "zlab", zlab_dflash_config(), _random(shapes, 24))
    eng = DFlashA.build(target8, engine_cfg(block_size=None, drafter=str(path), verify="batched"))
    assert eng.block == 16
    _lossless(eng, target8)


# ---------------------------------------------------------------- the bookkeeping set

def test_the_bookkeeping_set_covers_what_the_installed_transformers_writes():
    transformers = pytest.importorskip("transformers")
    from transformers.generation.configuration_utils import GenerationConfig

    written = set(transformers.PretrainedConfig().to_dict()) - {"model_type"}
    assert written <= BOOKKEEPING | set(INERT_DEFAULTS), written - BOOKKEEPING - set(INERT_DEFAULTS)
    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if defaults is not None:
        assert set(defaults()) <= BOOKKEEPING, set(defaults()) - BOOKKEEPING


def test_a_serialized_transformers_llama_config_passes_as_a_transformer_layer_config(target8, tmp_path):
    transformers = pytest.importorskip("transformers")
    layer = transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=HEADS,
                                     num_key_value_heads=KV, head_dim=HD, num_hidden_layers=1, vocab_size=V,
                                     max_position_embeddings=4096).to_dict()
    config = {**redhat_llama31_8b_speculator_config(), "transformer_layer_config": layer}
    c = load_eagle3(_write(tmp_path / "d", config, _eagle_tensors(25)), target8).config
    assert (c.hidden_size, c.head_dim, c.num_hidden_layers) == (H, HD, 1)


@pytest.mark.parametrize("field, value", [("torchscript", False), ("top_k", 50), ("base_model_tp_plan", None),
                                          ("id2label", {"0": "LABEL_0"}), ("tokenizer_class", "X"),
                                          ("is_decoder", False), ("_commit_hash", "abc")])
def test_bookkeeping_from_every_group_passes(target8, tmp_path, field, value):
    config = redhat_llama31_8b_speculator_config()
    config[field] = value
    config["transformer_layer_config"][field] = value
    load_eagle3(_write(tmp_path / "d", config, _eagle_tensors(26)), target8)


@pytest.mark.parametrize("field, value, message", [
    ("is_decoder", True, "field 'is_decoder' = true makes a model this loader does not implement"),
    ("pruned_heads", {"0": [1]}, "field 'pruned_heads'"),
    ("shiny_new_feature", 1, "config field(s) shiny_new_feature not implemented"),
])
def test_fields_that_change_the_model_are_still_refused(target8, tmp_path, field, value, message):
    config = redhat_llama31_8b_speculator_config()
    config[field] = value
    with pytest.raises(DrafterError) as e:
        load_eagle3(_write(tmp_path / "d", config, _eagle_tensors(27)), target8)
    assert message in str(e.value) and str(tmp_path / "d" / "config.json") in str(e.value)


# ---------------------------------------------------------------- typed fields

def _drafter_fixture(tmp_path, kind, edit):
    # A copy of the llama fixture's `kind` drafter ("dflash" or "eagle3") with config.json edited.
    dst = tmp_path / kind
    shutil.copytree(fixtures.drafter_dir(kind, "llama"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("loader, edit, field, what", [
    ("dflash", lambda c: c.update(block_size="eight"), "block_size", 'an integer >= 2 and <= 1024 or null, got "eight"'),
    ("dflash", lambda c: c["dflash_config"].update(block_size="eight"), "dflash_config.block_size", '"eight"'),
    ("dflash", lambda c: c.update(num_hidden_layers="two"), "num_hidden_layers", 'an integer >= 1 and <= 1024, got "two"'),
    ("dflash", lambda c: c.update(rms_norm_eps=None), "rms_norm_eps", "a finite number > 0 and <= 1, got null"),
    ("dflash", lambda c: c.update(hidden_size=2 ** 40), "hidden_size", "got 1099511627776"),
    ("dflash", lambda c: c.update(rope_theta=-1), "rope_theta", "got -1"),
    ("dflash", lambda c: c["dflash_config"].update(target_layer_ids=[1, "3"]), "dflash_config.target_layer_ids",
     "a list of integers"),
    ("dflash", lambda c: c.update(rope_scaling={"rope_type": "llama3"}), "rope_scaling", "missing 'factor'"),
    ("eagle3", lambda c: c["transformer_layer_config"].update(num_hidden_layers="two"),
     "transformer_layer_config.num_hidden_layers", '"two"'),
    ("eagle3", lambda c: c["transformer_layer_config"].update(rms_norm_eps=None),
     "transformer_layer_config.rms_norm_eps", "got null"),
    ("eagle3", lambda c: c.update(draft_vocab_size=512.5), "draft_vocab_size", "got 512.5"),
    ("eagle3", lambda c: c.update(norm_before_residual="yes"), "norm_before_residual", "true or false"),
    ("eagle3", lambda c: c.update(speculators_model_type="eagle"), "speculators_model_type", "one of eagle3"),
    ("eagle3", lambda c: c.update(transformer_layer_config=[]), "transformer_layer_config", "an object, got []"),
])
def test_a_mistyped_drafter_field_is_refused_in_one_line_naming_the_file_and_the_field(models, tmp_path, loader,
                                                                                        edit, field, what):
    path = _drafter_fixture(tmp_path, loader, edit)
    with pytest.raises(DrafterError) as e:
        (load_drafter if loader == "dflash" else load_eagle3)(path, models["llama"][0])
    msg = str(e.value)
    assert msg.startswith(f"{path / 'config.json'}: field '{field}' ") and what in msg and "\n" not in msg, msg
    assert "invalid literal" not in msg and "Traceback" not in msg


@pytest.mark.parametrize("loader", ["dflash", "eagle3"])
def test_a_drafter_config_that_is_not_json_names_the_file(models, tmp_path, loader):
    path = _drafter_fixture(tmp_path, loader, lambda c: None)
    (path / "config.json").write_text('{"hidden_size": 128,')
    with pytest.raises(DrafterError) as e:
        (load_drafter if loader == "dflash" else load_eagle3)(path, models["llama"][0])
    assert str(e.value).startswith(f"{path / 'config.json'} is not valid JSON")


def test_a_damaged_drafter_safetensors_header_names_the_file(models, tmp_path):
    path = _drafter_fixture(tmp_path, "dflash", lambda c: None)
    raw = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(raw[:8] + b"#" * 16 + raw[24:])
    with pytest.raises(DrafterError) as e:
        load_drafter(path, models["llama"][0])
    assert str(e.value).startswith(f"{path / 'model.safetensors'} is not a readable safetensors file")


# ---------------------------------------------------------------- targets

def _target(tmp_path, edit_text):
    dst = tmp_path / "target"
    shutil.copytree(fixtures.fixture_dir("llama"), dst)
    (dst / "config.json").write_text(edit_text((dst / "config.json").read_text()))
    return dst


def test_a_target_config_that_is_not_json_names_the_file(tmp_path):
    path = _target(tmp_path, lambda text: text[:-5])
    with pytest.raises(TargetError) as e:
        load_target(path, "float32")
    assert str(e.value).startswith(f"{path / 'config.json'} is not valid JSON") and "\n" not in str(e.value)


@pytest.mark.parametrize("field, value, what", [
    ("hidden_size", "big", 'an integer >= 1 and <= 1048576, got "big"'), ("num_hidden_layers", 10 ** 9, "got 1000000000"),
    ("rms_norm_eps", None, "got null"), ("intermediate_size", [256, "x"], "an integer or a list of integers"),
    ("vocab_size", 0, "got 0"), ("rope_theta", float("nan"), "got NaN"),
])
def test_a_mistyped_target_shape_field_is_refused_before_mlx_lm_sees_it(tmp_path, field, value, what):
    path = _target(tmp_path, lambda text: json.dumps({**json.loads(text), field: value}))
    with pytest.raises(TargetError) as e:
        load_target(path, "float32")
    assert str(e.value).startswith(f"{path / 'config.json'}: field '{field}' must be ") and what in str(e.value)


def test_a_target_whose_tensors_mlx_lm_refuses_names_the_checkpoint(tmp_path):
    path = _target(tmp_path, lambda text: json.dumps({**json.loads(text), "num_hidden_layers": 3}))
    with pytest.raises(TargetError) as e:  # the 4th layer's tensors are left over
        load_target(path, "float32")
    assert str(e.value).startswith(f"{path}: mlx-lm cannot load this checkpoint (ValueError: ")


def test_a_target_with_a_broken_config_is_an_error_record_naming_the_file_never_ok(tmp_path):
    from tests.test_cli import QUICK, harness, records

    path = _target(tmp_path, lambda text: text.replace('"hidden_size": 128', '"hidden_size": "128"'))
    r = harness(f"arch.model={path}", "method=ngram", *QUICK, f"out_dir={tmp_path / 'out'}")
    (rec,) = records(tmp_path / "out").values()  # recorded (the sweep goes on); its exit code is run.py's business
    assert rec["status"] == "error" and f"{path / 'config.json'}: field 'hidden_size'" in rec["reason"], r.stderr
