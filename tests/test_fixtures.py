import hashlib
import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from mlx_lm.models.switch_layers import SwitchGLU

from harness.models import fixtures
from harness.prompts import encode_turn, load_suite
from tests.conftest import ARCHS

LOSSLESS_NEW_TOKENS = 48  # test_lossless generates this many: more than the gemma window of 32


def test_every_fixture_is_a_checkpoint_directory_loaded_by_mlx_lm(models):
    for name in ARCHS:
        d = fixtures.fixture_dir(name)
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (d / f).is_file(), f"{name}: {f} missing"
        model, tok = models[name]
        assert model.model_type == json.loads((d / "config.json").read_text())["model_type"]
        assert len(model.layers) >= 4, f"{name} has too few layers to be a real test"
        assert model.model.embed_tokens.weight.shape[0] >= 1024
        assert tok.vocab_size >= 1024


def test_hybrid_fixture_has_deltanet_and_attention_layers(models):
    caches = models["qwen35"][0].make_cache()
    assert sum(isinstance(c, ArraysCache) for c in caches) >= 2
    assert sum(type(c) is KVCache for c in caches) >= 1


def test_gemma_fixtures_have_sliding_windows_shorter_than_the_test_generations(models):
    for name in ("gemma4", "gemma4_moe"):
        caches = models[name][0].make_cache()
        windows = [c.max_size for c in caches if isinstance(c, RotatingKVCache)]
        assert windows and max(windows) < LOSSLESS_NEW_TOKENS
        assert any(type(c) is KVCache for c in caches), "needs full attention layers too"
    assert any(isinstance(m, SwitchGLU) for _, m in models["gemma4_moe"][0].named_modules())


def test_fixture_init_and_build_are_deterministic(tmp_path):
    from mlx.utils import tree_flatten

    a, b = (dict(tree_flatten(fixtures.build_model("qwen35").parameters())) for _ in range(2))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    digests = []
    for run in ("a", "b"):
        dest = tmp_path / run
        fixtures.build_checkpoint("qwen35", dest)
        digests.append({f: hashlib.sha256((dest / f).read_bytes()).hexdigest()
                        for f in ("model.safetensors", "tokenizer.json", "config.json")})
    assert digests[0] == digests[1]


def test_shipped_weights_cover_every_parameter_of_the_seeded_model():
    from mlx.utils import tree_flatten

    for name in ARCHS:
        shipped = {k: v for k, v in mx.load(str(fixtures.SHIPPED_DIR / f"{name}.safetensors")).items()
                   if not k.startswith("mtp.")}  # the MTP head ships in the checkpoint, as in Qwen3.5
        init = dict(tree_flatten(fixtures.build_model(name).parameters()))
        assert shipped.keys() == init.keys(), name
        assert all(shipped[k].shape == init[k].shape for k in init), name


def test_prompts_are_wrapped_in_the_fixture_chat_template(models):
    _, tok = models["llama"]
    prompt = load_suite("builtin")[0]
    ids = encode_turn(tok, prompt, 0, [], chat_template=True)
    text = tok.decode(ids)
    assert text.startswith("<|user|>\n") and text.endswith("<|assistant|>\n")
    assert encode_turn(tok, prompt, 0, [], chat_template=False) == tok.encode(prompt.turns[0])


def test_fixture_weights_are_finite_and_logits_have_clear_margins(models):
    # Logits far inside gemma's soft-cap and top-1 margins well above float32 noise
    # make the lossless tests meaningful rather than lucky.
    for name in ARCHS:
        model, tok = models[name]
        logits = model(mx.array(tok.encode("The weather report for the coming week"))[None])[0, -1]
        top2 = mx.sort(logits)[-2:]
        assert mx.isfinite(logits).all().item()
        assert (top2[1] - top2[0]).item() > 1e-4
        assert mx.abs(logits).max().item() < 25


def test_scale_presets_build_on_first_use_with_random_drafters_beside_and_again_when_their_build_changes(
        tmp_path, monkeypatch):
    import json

    from harness.errors import ConfigError
    from harness.models import scale
    from harness.models.resolve import resolve_model

    monkeypatch.setenv("SPEC_HARNESS_HOME", str(tmp_path))
    path = resolve_model("scale:llama-tiny")
    assert path == tmp_path / "scale" / "llama-tiny" and (path / "model.safetensors").exists()
    drafter = json.loads((scale.drafter_dir(path, "dflash") / "config.json").read_text())
    assert drafter["block_size"] == 8 and drafter["hidden_size"] == 128 and drafter["vocab_size"] == 1024
    for kind in scale.DRAFTER_KINDS:
        assert (scale.drafter_dir(path, kind) / "model.safetensors").is_file(), kind
    stamp = path / "scale.json"
    built = stamp.stat().st_mtime_ns
    assert resolve_model("scale:llama-tiny") == path and stamp.stat().st_mtime_ns == built  # built once
    stamp.write_text(json.dumps({"preset": "llama-tiny", "build": "an older build"}))
    assert resolve_model("scale:llama-tiny") == path
    assert json.loads(stamp.read_text())["build"] == scale.build_hash("llama-tiny")  # rebuilt
    assert not list((tmp_path / "scale").glob(".*building*"))
    with pytest.raises(ConfigError, match="llama-1b"):
        resolve_model("scale:nope")