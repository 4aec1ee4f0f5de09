"""Checkpoint files: config.json + *.safetensors, read and written in one place.

Every field a loader reads from a config.json is declared once as a `Field` (its JSON kind,
its range, whether it may be absent or null) and read through `read_fields`, which refuses
a bad value in one line naming the file and the field. Fields that transformers' and
speculators' serialization write into every config.json without meaning anything for the
weights pass (`BOOKKEEPING`); anything else a loader does not implement is refused by name
(`refuse_unknown`), so a checkpoint part this code would silently drop never loads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engines.errors import DrafterError

# ---------------------------------------------------------------- bookkeeping fields

# What transformers' PretrainedConfig writes into every config.json (to_dict / to_diff_dict:
# __init__'s attributes, transformers_version, _name_or_path), read from
# src/transformers/configuration_utils.py of v4.4x-4.5x (the versions published drafters were
# saved with) and of v5 (dtype for torch_dtype, per-model generation defaults dropped). None of
# them changes what the weights compute at inference:
_TRANSFORMERS_BOOKKEEPING = {
    # provenance and the Python class to rebuild (auto_map: trust_remote_code's module name)
    "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "architectures", "auto_map",
    # storage and runtime switches: the harness casts weights to the target's dtype itself and
    # picks its own kernels and outputs; pretraining_tp only re-slices matmuls (same sums)
    "dtype", "torch_dtype", "use_bfloat16", "torchscript", "tf_legacy_loss", "return_dict",
    "output_hidden_states", "output_attentions", "attn_implementation", "use_cache", "chunk_size_feed_forward",
    "pretraining_tp", "gradient_checkpointing",
    # training-only: initialisation and dropout (off at inference)
    "initializer_range", "attention_dropout",
    # sequence classification / task heads a causal drafter does not have
    "finetuning_task", "id2label", "label2id", "num_labels", "problem_type", "task_specific_params", "prefix",
    "tokenizer_class",
    # special token ids: the target's tokenizer decides them, not the drafter
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
}
# Generation defaults (v4 _get_global_generation_defaults, v5 GenerationConfig.
# _get_default_generation_params): sampling settings saved into old configs; the harness's
# sampler decides them.
_GENERATION_DEFAULTS = {
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "encoder_repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "epsilon_cutoff", "eta_cutoff", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
}
# Class attributes of PretrainedConfig (has_no_defaults_at_init, the parallelism plans, ...) and
# of speculators' pydantic registry that speculators' SpeculatorModelConfig.to_dict
# (src/speculators/config.py) merges into the file; it strips some, releases leak the rest.
_CLASS_ATTRIBUTES = {
    "has_no_defaults_at_init", "is_composition", "sub_configs", "base_config_key", "attribute_map",
    "keys_to_ignore_at_inference", "base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan",
    "base_model_fsdp_plan", "_auto_class", "model_config", "auto_package", "registry_auto_discovery",
    "schema_discriminator",
}
# speculators' own: its version, and speculators_config (proposal methods, the verifier's
# name): how the checkpoint was meant to be served, not what it computes.
_SPECULATORS_BOOKKEEPING = {"speculators_version", "speculators_config"}
BOOKKEEPING = frozenset(_TRANSFORMERS_BOOKKEEPING | _GENERATION_DEFAULTS | _CLASS_ATTRIBUTES
                        | _SPECULATORS_BOOKKEEPING)

# PretrainedConfig fields that pass only at transformers' default: another value makes a
# different model (an encoder-decoder, cross-attention, pruned heads) than these loaders build.
INERT_DEFAULTS = {"is_encoder_decoder": False, "is_decoder": False, "add_cross_attention": False,
                  "cross_attention_hidden_size": None, "tie_encoder_decoder": False, "pruned_heads": {}}

# Bounds far beyond any published model, so an absurd size is refused before it is allocated.
MAX_WIDTH = 1 << 20  # hidden / intermediate / head sizes
MAX_VOCAB = 1 << 22
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_POSITIONS = (1 << 31) - 1


# ---------------------------------------------------------------- typed fields

REQUIRED = object()


@dataclass(frozen=True)
class Field:
    """What one config.json field must hold. kind: "int", "number", "bool", "str", "dict",
    "ints" / "strs" (a list of them), or "dims" (an int, or a list of ints: one per layer);
    ge / gt / le bound numbers (and list items); choices
    bound strings; default REQUIRED means absent is refused; null_ok: JSON null reads as
    the default."""

    kind: str
    default: object = REQUIRED
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple = ()
    null_ok: bool = False

    def describe(self) -> str:
        base = {"int": "an integer", "number": "a finite number", "bool": "true or false", "str": "a string",
                "dict": "an object", "ints": "a list of integers", "strs": "a list of strings",
                "dims": "an integer or a list of integers"}[self.kind]
        bounds = [f">= {_num(self.ge)}" if self.ge is not None else "", f"> {_num(self.gt)}" if self.gt is not None
                  else "", f"<= {_num(self.le)}" if self.le is not None else ""]
        text = base + (" " + " and ".join(b for b in bounds if b) if any(bounds) else "")
        if self.choices:
            text += " (one of " + ", ".join(map(str, self.choices)) + ")"
        return text + (" or null" if self.null_ok else "")


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _scalar(kind: str, v) -> bool:
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "number":
        try:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        except OverflowError:  # an integer literal beyond any float
            return False
    return isinstance(v, {"bool": bool, "str": str, "dict": dict}[kind])


def _fits(f: Field, v) -> bool:
    kind = {"ints": "int", "strs": "str", "dims": "int"}.get(f.kind, f.kind)
    listed = f.kind in ("ints", "strs") or (f.kind == "dims" and isinstance(v, list))
    items = v if listed else [v]
    if listed and not isinstance(v, list):
        return False
    for x in items:
        if not _scalar(kind, x) or (f.choices and x not in f.choices):
            return False
        if kind in ("int", "number") and ((f.ge is not None and x < f.ge) or (f.gt is not None and x <= f.gt)
                                          or (f.le is not None and x > f.le)):
            return False
    return True


def shown(value) -> str:
    """A config value as the file spells it, cut to stay on one line."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_fields(cfg: dict, fields: dict[str, Field], where, prefix: str = "", error=DrafterError) -> dict:
    """{name: value} for every field in `fields`: checked against its Field, the default where
    absent (or null, where null is allowed); `error` "<where>: field '<prefix><name>' must be
    <what>, got <value>" for the first that is not. Lists come back as tuples."""
    out = {}
    for name, f in fields.items():
        v = cfg.get(name, REQUIRED)
        if v is REQUIRED or (v is None and f.null_ok):
            if f.default is REQUIRED:
                raise error(f"{where}: field '{prefix}{name}' is missing; it must be {f.describe()}")
            out[name] = f.default
            continue
        if not _fits(f, v):
            raise error(f"{where}: field '{prefix}{name}' must be {f.describe()}, got {shown(v)}")
        out[name] = float(v) if f.kind == "number" else tuple(v) if isinstance(v, list) else v
    return out


def refuse_unknown(names, known, what: str, where, fix: str, error=DrafterError) -> None:
    """`error` naming every entry of `names` outside `known`: a checkpoint part this code would
    silently drop changes what the model computes, so it is refused, never ignored."""
    extra = sorted(set(names) - set(known))
    if extra:
        shown_ = ", ".join(extra[:6]) + (f" (+{len(extra) - 6} more)" if len(extra) > 6 else "")
        raise error(f"{where}: {what} {shown_} not implemented by this loader; {fix}")


def refuse_unknown_fields(cfg: dict, implemented, where, prefix: str = "", fix: str = "") -> None:
    """refuse_unknown for a config section: its implemented fields and BOOKKEEPING pass, and
    INERT_DEFAULTS pass at transformers' default only."""
    fix = fix or "remove it if it is bookkeeping, or use a drafter in a layout this harness implements"
    what = f"{prefix.rstrip('.') + ' ' if prefix else 'config '}field(s)"
    refuse_unknown(cfg, set(implemented) | BOOKKEEPING | set(INERT_DEFAULTS), what, where, fix)
    for name, default in INERT_DEFAULTS.items():
        if name in cfg and cfg[name] != default:
            raise DrafterError(f"{where}: field '{prefix}{name}' = {shown(cfg[name])} makes a model this loader does "
                               f"not implement (only transformers' default {shown(default)} is)")


# ---------------------------------------------------------------- files

def read_json(file: Path, error=DrafterError) -> dict:
    """The JSON object in `file`; `error` naming the file if it is unreadable, not JSON, or not an object."""
    try:
        cfg = json.loads(Path(file).read_bytes())
    except OSError as e:
        raise error(f"{file} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise error(f"{file} is not valid JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as e:
        raise error(f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{file} is not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer literal past Python's digit limit
        raise error(f"{file} is not readable JSON ({' '.join(str(e).split())[:120]})") from None
    if not isinstance(cfg, dict):
        raise error(f"{file} must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def read_config(path: Path, what: str) -> dict:
    """config.json of the drafter directory `path`; DrafterError if absent or malformed."""
    if not (path / "config.json").is_file():
        raise DrafterError(f"{path} has no config.json: not {what} directory")
    return read_json(path / "config.json")


def load_safetensors(file: Path, error=DrafterError) -> dict[str, mx.array]:
    """mx.load of one safetensors file; `error` naming the file when its header or size is damaged."""
    try:
        return mx.load(str(file))
    except (RuntimeError, ValueError, OSError) as e:
        raise error(f"{file} is not a readable safetensors file ({' '.join(str(e).split())[:200]})") from None


def read_tensors(path: Path, rename=lambda k: k) -> dict[str, mx.array]:
    """Every tensor of every *.safetensors in `path` (or, where there are none, of a torch
    `pytorch_model.bin`, read without torch or pickle code), keys passed through `rename`."""
    files = sorted(path.glob("*.safetensors"))
    if not files and (path / "pytorch_model.bin").is_file():
        from engines.runtime.torch_bin import read_torch_bin  # numpy and a zip reader, for .bin checkpoints only

        return {rename(k): v for k, v in read_torch_bin(path / "pytorch_model.bin").items()}
    if not files:
        raise DrafterError(f"{path} has no *.safetensors and no pytorch_model.bin: no weights to load")
    out = {}
    for f in files:
        out.update({rename(k): v for k, v in load_safetensors(f).items()})
    return out


# The RoPE fields of a layer config: transformers v4 (rope_theta + rope_scaling) or v5 (rope_parameters).
ROPE_FIELDS = {"rope_theta": Field("number", None, gt=0, null_ok=True), "rope_scaling": Field("dict", None, null_ok=True),
               "rope_parameters": Field("dict", None, null_ok=True)}


def rope_settings(cfg: dict, where="config.json", prefix: str = "") -> tuple[float, dict | None]:
    """(theta, scaling dict for mlx-lm's initialize_rope) from a transformers v4 config
    (rope_theta + rope_scaling) or a v5 one (rope_parameters, possibly one per layer type);
    DrafterError naming the field when one has the wrong type."""
    f = read_fields(cfg, ROPE_FIELDS, where, prefix)
    params, key = f["rope_parameters"], "rope_parameters"
    if params and {"full_attention", "sliding_attention"} & set(params):  # one per layer type
        key = f"rope_parameters.{'sliding_attention' if params.get('sliding_attention') else 'full_attention'}"
        params = params.get("sliding_attention") or params.get("full_attention")  # as speculators collapses it
        if not isinstance(params, dict):
            raise DrafterError(f"{where}: field '{prefix}{key}' must be an object, got {shown(params)}")
    scaling = params or f["rope_scaling"]
    theta = f["rope_theta"]
    if theta is None:
        inner = {"rope_theta": Field("number", 10000.0, gt=0, null_ok=True)}
        theta = read_fields(scaling or {}, inner, where, f"{prefix}{key if params else 'rope_scaling'}.")["rope_theta"]
    return theta, scaling


def check_rope(theta: float, scaling: dict | None, dims: int, max_positions: int, where, field: str) -> None:
    """DrafterError naming `field` unless mlx-lm's initialize_rope builds this RoPE (a type it
    implements, with the parameters that type needs)."""
    from mlx_lm.models.rope_utils import initialize_rope

    try:
        initialize_rope(dims, base=theta, traditional=False, scaling_config=scaling,
                        max_position_embeddings=max_positions)
    except (KeyError, TypeError, ValueError, AssertionError, ZeroDivisionError, AttributeError) as e:
        detail = f"missing {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:120]
        raise DrafterError(f"{where}: field '{field}' is not a RoPE setting mlx-lm implements ({detail}), "
                           f"got {shown(scaling)}") from None


_QUANT = {"group_size": Field("int", ge=16, le=1024), "bits": Field("int", ge=2, le=8)}


def quantize_like(module: nn.Module, weights: dict, config: dict, where) -> frozenset:
    """Make the linear layers that `weights` stores quantized (mlx-lm's layout: a packed uint32
    weight with scales and biases, config.json `quantization: {group_size, bits}`) quantized in
    `module` too, so the strict shape check reads them; returns the packed weights' names.
    DrafterError where the tensors and config.json disagree."""
    packed = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    q = config.get("quantization")
    if not packed and q is None:
        return frozenset()
    if not isinstance(q, dict):
        raise DrafterError(f"{where}: tensors such as {sorted(packed)[0]}.scales are quantized, but config.json has no "
                           "quantization: {group_size, bits} (mlx-lm's field) to read them with")
    q = read_fields(q, _QUANT, where, "quantization.")
    nn.quantize(module, q["group_size"], q["bits"], class_predicate=lambda p, m: p in packed and hasattr(m, "to_quantized"))
    return frozenset(f"{p}.weight" for p in packed)


def keeps_quantized(device_type, cuda: bool) -> bool:
    """Whether a quantized drafter runs as it is on this backend: on Metal only. MLX's CPU
    quantized matmul runs about 20x slower than a float32 GEMM at drafter shapes (a
    [4, 576] x [576, 8192] product: 18 ms 4-bit against 0.9 ms float32, 2 cores with MKL), and
    MLX's CUDA backend JIT-compiles its quantized matmuls per shape: a 4-bit DFlash drafter
    spent over 79 s of a SmolLM2 cell's first generation compiling on the H200, its bf16 copy
    11 s (docs/benchmarks/2026-12-04-smollm2-run4)."""
    return device_type == mx.gpu and not cuda


def float_drafter(module: nn.Module, dtype) -> bool:
    """Where quantized layers do not pay (`keeps_quantized`), turn `module`'s quantized layers
    back into float layers of `dtype` (the same values: a weight is what its packed form
    decodes to); True when it did."""
    if keeps_quantized(mx.default_device().type, mx.cuda.is_available()):
        return False
    from mlx_lm.utils import dequantize_model

    quantized = any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in module.named_modules())
    if quantized:
        dequantize_model(module)
        module.apply(lambda w: w.astype(dtype) if mx.issubdtype(w.dtype, mx.floating) else w)
    return quantized


def check_tensors(weights: dict, expected: dict[str, tuple], what: str, path: Path, packed=frozenset()) -> None:
    """Every expected tensor present with its shape and a floating-point dtype (uint32 for the
    `packed` weights of quantized layers), or DrafterError naming the first that is not."""
    for name, shape in expected.items():
        if name not in weights:
            raise DrafterError(f"{what} tensor {name} is missing from {path}")
        w = weights[name]
        if tuple(w.shape) != tuple(shape):
            raise DrafterError(f"{path}: {what} tensor {name} has shape {tuple(w.shape)}, config says {tuple(shape)}")
        if name in packed:
            if w.dtype != mx.uint32:
                raise DrafterError(f"{path}: {what} tensor {name} is {str(w.dtype).split('.')[-1]}, not a packed uint32 "
                                   "quantized weight")
            continue
        if not mx.issubdtype(w.dtype, mx.floating):
            raise DrafterError(f"{path}: {what} tensor {name} is {str(w.dtype).split('.')[-1]}, not a floating-point "
                               "weight")


def write_checkpoint(path: Path, config: dict, weights: dict[str, mx.array], dtype=mx.bfloat16) -> None:
    """config.json + model.safetensors, floating tensors cast to `dtype`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})


def qwen3_layer_types(n: int, use_sliding_window: bool | None, sliding_window: int | None,
                      max_window_layers: int | None) -> list[str]:
    """transformers' Qwen2/Qwen3 rule where a config has no layer_types: with use_sliding_window,
    the layers from max_window_layers (default 28) on slide; otherwise none does."""
    if not (use_sliding_window and sliding_window):
        return ["full_attention"] * n
    first = 28 if max_window_layers is None else max_window_layers
    return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]


# The fields of a Llama / Qwen3-type decoder layer these drafters build, as config.json holds them.
LAYER_TYPES = ("full_attention", "sliding_attention")
SLIDING_FIELDS = {"layer_types": Field("strs", None, choices=LAYER_TYPES, null_ok=True),
                  "sliding_window": Field("int", None, ge=1, le=MAX_POSITIONS, null_ok=True),
                  "use_sliding_window": Field("bool", None, null_ok=True),
                  "max_window_layers": Field("int", None, ge=0, le=MAX_LAYERS, null_ok=True)}


def attention_types(f: dict, n: int, where, prefix: str = "") -> tuple[str, ...]:
    """The attention type of each of the n layers from SLIDING_FIELDS values `f`: layer_types as
    written, or Qwen3's rule; DrafterError naming the field when they do not fit."""
    types = f["layer_types"] or tuple(qwen3_layer_types(n, f["use_sliding_window"], f["sliding_window"],
                                                       f["max_window_layers"]))
    if len(types) != n:
        raise DrafterError(f"{where}: field '{prefix}layer_types' must list full_attention/sliding_attention once "
                           f"per layer ({n}), got {len(types)}")
    if "sliding_attention" in types and not f["sliding_window"]:
        raise DrafterError(f"{where}: sliding_attention layers need field '{prefix}sliding_window'")
    return tuple(types)
