"""GGUF files as targets: each file is converted once into an ordinary mlx-lm checkpoint.

`arch.model=<file.gguf>` (or a directory holding one) resolves here. The file is read
with llama.cpp's own reader (the `gguf` package) and with `mx.load`, and written into
the harness's cache as config.json + model.safetensors + tokenizer.json +
tokenizer_config.json (chat template from the metadata), so every engine, drafter
loader and reference arm loads it through `mlx_lm.load` like any checkpoint.

What the conversion does to the weights, per tensor type:
- Q4_0, Q4_1, Q8_0 (the types MLX reads natively): `mx.load` returns them as MLX affine
  quantization in groups of 32 (weight, scales, biases), bit-exact. With `dequantize`
  false they stay quantized; otherwise MLX dequantizes them to the requested dtype.
- F32 / F16 / BF16: as stored, or cast to the requested dtype.
- every other type (K-quants, IQ-quants, ...): dequantized by the `gguf` package's numpy
  dequantizer (llama.cpp's reference) in float32, then cast to the requested dtype
  (float16 when the file's own precision is kept).
and the transforms llama.cpp's converter documents, undone exactly:
- llama: the rows of attn_q / attn_k were permuted for its rope layout (pairs of
  halves interleaved per head); the inverse permutation moves weight, scales and biases
  rows together.
- gemma3: RMSNorm weights were stored as 1 + w; 1 is subtracted (in float32).
Anything the importer does not know (an architecture, a tensor name, a tokenizer
pre-split) is refused in one line: a model that loads partially is worse than none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from engines.home import home
from harness.errors import GGUFError
from harness.models.gguf_tokenizer import build_tokenizer

CONVERTER_VERSION = 1  # bump when the output of a conversion changes; old cache entries are rebuilt
NATIVE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")  # what mx.load returns without loss
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
GROUP_SIZE = 32  # the block size of every natively read quant type


# ---------------------------------------------------------------------------------------
# Architectures: config from metadata, tensor names, and the transforms to undo.


def _common(meta: dict, arch: str, names: set[str]) -> dict:
    key = lambda k, default=None: meta.get(f"{arch}.{k}", default)  # noqa: E731
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    cfg = {
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": key("context_length"),
        "vocab_size": key("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in names,
    }
    head_dim = key("attention.key_length")
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    theta = key("rope.freq_base")
    if theta is not None:
        cfg["rope_theta"] = theta
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"rope scaling {scaling!r} ({arch}.rope.scaling.type) is not supported by this importer; "
                            "only linear scaling and none are")
        cfg["rope_scaling"] = {"type": "linear", "rope_type": "linear", "factor": key("rope.scaling.factor")}
    missing = [k for k, v in cfg.items() if v is None]
    if missing:
        raise GGUFError(f"metadata lacks {', '.join(missing)} for architecture {arch!r}")
    return cfg


def _llama_config(meta, names):
    cfg = _common(meta, "llama", names)
    rope_dim = meta.get("llama.rope.dimension_count")
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if rope_dim is not None and rope_dim != head_dim:
        raise GGUFError(f"llama.rope.dimension_count={rope_dim} differs from the head dim {head_dim}: "
                        "partial rotary embeddings are not supported by this importer")
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **cfg,
            "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": False}


def _qwen2_config(meta, names):
    cfg = _common(meta, "qwen2", names)
    cfg.pop("head_dim", None)  # mlx-lm's qwen2 derives it
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **cfg}


def _qwen3_config(meta, names):
    cfg = _common(meta, "qwen3", names)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **cfg}


def _gemma3_config(meta, names):
    cfg = _common(meta, "gemma3", names)
    cfg.pop("tie_word_embeddings")  # mlx-lm's gemma3_text ties whenever lm_head is absent
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    window = meta.get("gemma3.attention.sliding_window")
    if window is None:
        raise GGUFError("metadata lacks gemma3.attention.sliding_window")
    # llama.cpp fixes what Gemma 3 files do not state: every 6th layer global, local rope base
    # 10000, and queries scaled by the head dim (llama-model.cpp, LLM_ARCH_GEMMA3).
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **cfg,
            "sliding_window": window, "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": cfg["head_dim"]}


_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "attn_norm": "input_layernorm"}
_DENSE_NORMS = {"ffn_norm": "post_attention_layernorm"}
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class ArchSpec:
    config: Callable[[dict, set], dict]
    layer_names: dict  # GGUF per-layer stem -> mlx-lm module path under model.layers.N
    tensors: tuple[str, ...]  # per-layer stems this architecture may have
    permute_qk: bool = False  # llama.cpp permuted q/k rows for its rope (LlamaModel only)
    norm_offset: bool = False  # norms stored as 1 + w (Gemma)


ARCHS = {
    "llama": ArchSpec(_llama_config, {**_ATTN, **_DENSE_NORMS},
                      ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm",
                       "ffn_norm"), permute_qk=True),
    "qwen2": ArchSpec(_qwen2_config, {**_ATTN, **_DENSE_NORMS},
                      ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_norm",
                       "ffn_norm")),
    "qwen3": ArchSpec(_qwen3_config, {**_ATTN, **_DENSE_NORMS},
                      ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_gate", "ffn_up",
                       "ffn_down", "attn_norm", "ffn_norm")),
    "gemma3": ArchSpec(_gemma3_config, {**_ATTN, **_GEMMA_NORMS},
                       ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_gate", "ffn_up",
                        "ffn_down", "attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"),
                       norm_offset=True),
}

_NAME = re.compile(r"^(?:blk\.(\d+)\.)?([a-z0-9_]+)\.(weight|bias)$")


def hf_name(spec: ArchSpec, name: str, arch: str, n_layers: int) -> str:
    """The mlx-lm parameter name of GGUF tensor `name`; GGUFError for one with no place."""
    m = _NAME.match(name)
    if m:
        layer, stem, leaf = m.groups()
        if layer is None and stem in _TOP:
            return f"{_TOP[stem]}.{leaf}"
        if layer is not None and int(layer) < n_layers and stem in spec.tensors:
            return f"model.layers.{layer}.{spec.layer_names[stem]}.{leaf}"
    if name == "rope_freqs.weight":
        raise GGUFError("the file carries rope_freqs (Llama 3.1-style rope scaling factors), which this importer "
                        "does not convert yet; use a file without rope scaling")
    raise GGUFError(f"tensor {name!r} has no place in a {arch} model as this importer builds it; refusing to load "
                    "the file partially")


def _unpermute_rows(x, n_head: int):
    # Inverse of llama.cpp's permute: rows were [head, half, pair] -> [head, pair, half].
    rows = x.shape[0]
    return x.reshape(n_head, rows // n_head // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


# ---------------------------------------------------------------------------------------
# Reading and converting.


@dataclass
class Source:
    path: Path
    sha256: str
    size: int
    meta: dict = field(repr=False)
    tensors: list = field(repr=False)  # gguf ReaderTensor
    arch: str = ""


def read_source(path: Path) -> Source:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 -- any parse failure: the file is not a GGUF we can read
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHS)}")
    return Source(path, file_sha256(path), path.stat().st_size, meta, list(reader.tensors), arch)


def file_sha256(path: Path) -> str:
    """sha256 of the file, remembered per (path, size, mtime) so a big file is hashed once."""
    index, key = _sha256_index(path)
    known = _read_index(index)
    if key not in known:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        remember_sha256(path, h.hexdigest())
        return h.hexdigest()
    return known[key]


def remember_sha256(path: Path, sha256: str) -> None:
    """Note `path`'s sha256 (hashed by whoever wrote it) so file_sha256 need not read it again."""
    index, key = _sha256_index(path)
    known = _read_index(index)
    known[key] = sha256
    index.parent.mkdir(parents=True, exist_ok=True)
    tmp = index.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, index)


def _sha256_index(path: Path) -> tuple[Path, str]:
    st = path.stat()
    return home() / "gguf" / "sha256.json", f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def _read_index(index: Path) -> dict:
    try:
        return json.loads(index.read_text())
    except (OSError, ValueError):
        return {}


def convert_weights(src: Source, config: dict, dtype: str) -> tuple[dict, dict, dict]:
    """(mlx-lm weights, quantization config or {}, per-type report) for `src` in `dtype`.

    dtype "native" keeps the natively read quant types quantized and floats as stored;
    float32 / float16 / bfloat16 dequantize every tensor to that dtype."""
    import mlx.core as mx
    import numpy as np
    from gguf import quants

    spec = ARCHS[src.arch]
    n_layers = config["num_hidden_layers"]
    loaded = _mx_load(src.path)
    target = None if dtype == "native" else getattr(mx, dtype)
    weights, qbits, report = {}, {}, {}
    for t in src.tensors:
        tname = t.tensor_type.name
        name = hf_name(spec, t.name, src.arch, n_layers)
        module = name.rsplit(".", 1)[0]
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
        if tname in NATIVE_TYPES and loaded is not None and t.name in loaded:
            parts = {"weight": loaded[t.name]}
            stem = t.name.rsplit(".", 1)[0]
            if tname in QUANT_BITS:
                parts.update(scales=loaded[f"{stem}.scales"], biases=loaded[f"{stem}.biases"])
            how = "mx.load"
        else:  # dequantized by llama.cpp's reference code, in float32
            arr = quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
            parts = {"weight": mx.array(arr).astype(target or mx.float16)}
            how = "gguf.dequantize"
        if "scales" in parts and target is not None:  # dequantize MLX's own layout in float32, exact
            parts = {"weight": mx.dequantize(parts["weight"], parts["scales"].astype(mx.float32),
                                             parts["biases"].astype(mx.float32), group_size=GROUP_SIZE,
                                             bits=QUANT_BITS[tname]).astype(target)}
            how += "+mx.dequantize"
        elif "scales" in parts:
            qbits[module] = QUANT_BITS[tname]
        elif target is not None:
            parts["weight"] = parts["weight"].astype(target)
        assert "scales" in parts or parts["weight"].shape == shape, (t.name, parts["weight"].shape, shape)
        parts = _undo_transforms(spec, name, parts, config)
        leaf = name.rsplit(".", 1)[1]  # weight | bias
        for k, v in parts.items():
            weights[f"{module}.{leaf if k == 'weight' else k}"] = v
        entry = report.setdefault(tname, {"tensors": 0, "read_by": set()})
        entry["tensors"] += 1
        entry["read_by"].add(how)
    report = {k: {"tensors": v["tensors"], "read_by": sorted(v["read_by"])} for k, v in report.items()}
    return weights, _quant_config(qbits), report


def _mx_load(path: Path):
    # mx.load reads the natively supported types bit-exactly; a type it cannot read at all
    # sends every tensor through the gguf dequantizer instead (recorded per type).
    import mlx.core as mx

    try:
        return mx.load(str(path))
    except Exception:  # noqa: BLE001
        return None


def _undo_transforms(spec: ArchSpec, name: str, parts: dict, config: dict) -> dict:
    import mlx.core as mx

    if spec.permute_qk and (".q_proj." in name or ".k_proj." in name):
        heads = config["num_attention_heads"] if ".q_proj." in name else config["num_key_value_heads"]
        parts = {k: _unpermute_rows(v, heads) for k, v in parts.items()}
    if spec.norm_offset and name.endswith("norm.weight"):
        w = parts["weight"]
        parts = {"weight": (w.astype(mx.float32) - 1.0).astype(w.dtype)}
    return parts


def _quant_config(qbits: dict) -> dict:
    if not qbits:
        return {}
    default = max(set(qbits.values()), key=list(qbits.values()).count)
    q = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    q.update({m: {"group_size": GROUP_SIZE, "bits": b} for m, b in sorted(qbits.items()) if b != default})
    return q


def cache_dir(src: Source, dtype: str) -> Path:
    return home() / "gguf" / f"{src.path.stem}-{src.sha256[:12]}-{dtype}-v{CONVERTER_VERSION}"


def convert(path: Path, dtype: str, log=None) -> Path:
    """The mlx-lm checkpoint directory for GGUF `path` in `dtype`, converted on first use.

    Written into a temporary directory and renamed into place, so a killed conversion
    leaves nothing half-written behind."""
    src = read_source(path)
    dest = cache_dir(src, dtype)
    if (dest / "conversion.json").is_file():
        return dest
    if log:
        log(f"  converting {path.name} ({src.size / 1e6:.0f} MB, {src.arch}) to an mlx-lm checkpoint in {dtype} "
            f"-> {dest}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        _write_checkpoint(src, dtype, tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process finished the same conversion first
            if not (dest / "conversion.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_checkpoint(src: Source, dtype: str, dest: Path) -> None:
    import mlx.core as mx

    names = {t.name for t in src.tensors}
    config = ARCHS[src.arch].config(src.meta, names)
    weights, quant, types = convert_weights(src, config, dtype)
    if quant:
        config["quantization"] = quant
    tokenizer, tok_config = build_tokenizer(src.meta, src.path.name)
    for k, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("pad_token_id", "padding_token_id")):
        if src.meta.get(f"tokenizer.ggml.{meta_key}") is not None:
            config[k] = src.meta[f"tokenizer.ggml.{meta_key}"]
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    record = {"file": str(src.path.resolve()), "name": src.path.name, "sha256": src.sha256, "bytes": src.size,
              "architecture": src.arch, "model_type": config["model_type"], "dtype": dtype,
              "tensor_types": types, "quantization": quant or None,
              "transforms": _transforms(ARCHS[src.arch]), "general.name": src.meta.get("general.name"),
              "converter": CONVERTER_VERSION, "versions": _versions()}
    (dest / "conversion.json").write_text(json.dumps(record, indent=2))


def _transforms(spec: ArchSpec) -> list[str]:
    out = []
    if spec.permute_qk:
        out.append("attn_q/attn_k rows un-permuted (llama.cpp's rope layout)")
    if spec.norm_offset:
        out.append("norm weights stored as 1 + w: 1 subtracted")
    return out


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("gguf", "mlx", "tokenizers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def conversion_record(ckpt: Path) -> dict | None:
    """What the record says about a converted GGUF checkpoint (None for any other dir)."""
    p = Path(ckpt) / "conversion.json"
    return json.loads(p.read_text()) if p.is_file() else None


def find_gguf(path: Path) -> Path | None:
    """`path` itself if it is a .gguf file, the one .gguf inside a directory, else None;
    several candidates in one directory are refused (which one was meant is unknowable)."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise GGUFError(f"{path} holds {len(found)} .gguf files ({', '.join(p.name for p in found)}); "
                            "pass arch.model=<one of them>")
        return found[0] if found else None
    return None
