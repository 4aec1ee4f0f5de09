"""Model specs are parsed in one place (harness/models/resolve.py) for targets and drafters,
and a drafter spec that cannot be met says so without building anything."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines.errors import Unsupported
from harness.errors import ConfigError
from harness.models.resolve import Spec, parse_spec, resolve_drafter


def _cfg(model: str, drafter: str | None = None):
    return SimpleNamespace(arch=SimpleNamespace(model=model, dtype="float32", gguf_dequantize=True),
                           method=SimpleNamespace(drafter=drafter))


@pytest.mark.parametrize("spec, parsed", [
    ("fixture:llama-q4", Spec("fixture", "llama-q4")), ("scale:llama-1b", Spec("scale", "llama-1b")),
    ("smollm2", Spec("named", "smollm2")), ("/models/x.gguf", Spec("path", "/models/x.gguf")),
    ("fixtures:llama", Spec("path", "fixtures:llama")),  # only the exact prefixes name a kind
])
def test_each_spec_kind_is_told_apart_by_its_prefix_or_name(spec, parsed):
    assert parse_spec(spec) == parsed


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "draft_model"])
def test_a_real_target_without_a_drafter_is_an_unsupported_cell_not_bad_input(tmp_path, kind):
    with pytest.raises(Unsupported, match=f"arch.model={tmp_path}"):
        resolve_drafter(_cfg(str(tmp_path)), kind)


def test_a_scale_preset_without_a_smaller_sibling_has_no_draft_model_and_says_so_before_building():
    with pytest.raises(Unsupported, match="arch.model=scale:llama-1b: the preset has no smaller shape"):
        resolve_drafter(_cfg("scale:llama-1b"), "draft_model")


def test_each_scale_target_drafts_with_its_familys_smaller_shape():
    from harness.models.scale import DRAFT_MODEL, PRESETS

    for target, draft in DRAFT_MODEL.items():
        t, d = PRESETS[target], PRESETS[draft]
        assert d["model_type"] == t["model_type"] and d["hidden_size"] < t["hidden_size"], (target, draft)
        assert d["vocab_size"] == t["vocab_size"], (target, draft)  # one tokenizer: the draft model's check


@pytest.mark.parametrize("preset", ["llama-1b", "llama-3b", "llama-8b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen35-1b"])
def test_a_scale_presets_drafters_are_of_its_width_and_read_as_their_kind(preset):
    from engines.drafters.dflash import DFlashConfig
    from engines.drafters.eagle3 import Eagle3Config
    from harness.models.scale import PRESETS, dflash_spec, eagle3_spec

    spec = PRESETS[preset]
    d = DFlashConfig.from_json(dflash_spec(preset), preset)
    e = Eagle3Config.from_json(eagle3_spec(preset), preset)
    assert d.hidden_size == e.hidden_size == e.target_hidden_size == spec["hidden_size"]
    assert e.intermediate_size == spec["intermediate_size"] and e.num_key_value_heads == spec["num_key_value_heads"]
    assert len(set(e.aux_layer_ids)) == 3 and max(e.aux_layer_ids) < spec["num_hidden_layers"]


def test_an_unknown_fixture_drafter_lists_the_ones_there_are():
    with pytest.raises(ConfigError, match=r"method.drafter=fixture:nope: .*available: .*dflash:llama"):
        resolve_drafter(_cfg("fixture:llama", "fixture:nope"), "dflash")


def test_a_drafter_path_must_hold_a_config_and_is_passed_through_when_it_does(tmp_path):
    with pytest.raises(ConfigError, match="is not a drafter directory"):
        resolve_drafter(_cfg("fixture:llama", str(tmp_path)), "dflash")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_drafter(_cfg("/elsewhere", str(tmp_path)), "eagle3") == str(tmp_path)
