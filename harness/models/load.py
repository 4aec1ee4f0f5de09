"""Loading a checkpoint directory (resolve.py's answer), offline, through `mlx_lm.load`.

Its files are checked before mlx-lm builds anything from them: config.json's shape fields
typed and bounded (TARGET_FIELDS), every safetensors header read. A checkpoint whose files
are there but damaged (config.json not JSON or with a mistyped or absurd shape field, an
unreadable safetensors header, tensors mlx-lm refuses) is a TargetError naming the file: the
cell is recorded as `error` with that reason (never `ok`) and a sweep goes on to its next cell.
"""

from __future__ import annotations

from pathlib import Path

from engines.runtime import shared_weights
from engines.runtime.checkpoint import (MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, Field,
                                        load_safetensors, read_fields, read_json)
from harness.errors import ConfigError, TargetError
from harness.models.fixtures import cast_model

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
            cast_model(model, getattr(mx, dtype))
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
