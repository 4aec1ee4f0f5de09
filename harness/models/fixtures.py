"""Embedded default models: tiny checkpoints of every supported architecture.

Each fixture is an mlx-lm model (its own ModelArgs/Model classes) written in the
on-disk layout real checkpoints use (config.json, model.safetensors in bfloat16,
tokenizer.json + tokenizer_config.json with a chat template) and loaded back through
`mlx_lm.load`, the same path a local Hugging Face checkout takes. Nothing is
downloaded: the tokenizer is a byte-level BPE trained with `tokenizers` on text this
project ships (harness/data/corpus.txt, which holds no benchmark prompt), and the weights
start from a fixed-seed init (`build_model`) and are trained on that text by
train/fixtures.py (through train/'s loop and objectives); the trained weights and the tokenizer ship in
harness/data/fixtures/.

Checkpoints are assembled on first use into a cache directory (SPEC_HARNESS_HOME,
default ~/.cache/spec-harness) under a name that includes a hash of their spec and
shipped files, so a changed spec never reuses a stale build.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import tempfile
from pathlib import Path

from engines.home import home

DATA_DIR = Path(__file__).parent.parent / "data"  # harness/data
SHIPPED_DIR = DATA_DIR / "fixtures"
VOCAB_SIZE = 1024
SEED = 1234
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|mask|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Scale of the random weights: small enough that logits stay well inside gemma's
# soft-cap (saturated logits would tie), large enough that argmax margins are wide.
INIT_STD = 0.08

_COMMON = {"vocab_size": VOCAB_SIZE, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "max_position_embeddings": 4096, "bos_token_id": 0, "eos_token_id": 0}

# Every spec is a config.json for mlx-lm; comments say which feature it exercises.
FIXTURES: dict[str, dict] = {
    # Dense full attention.
    "llama": {**_COMMON, "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 4,
              "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "rope_theta": 10000.0},
    # Hybrid: layers 0-2 Gated DeltaNet (ArraysCache), layer 3 full attention (KVCache).
    "qwen35": {**_COMMON, "model_type": "qwen3_5", "hidden_size": 128, "num_hidden_layers": 4,
               "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 64, "full_attention_interval": 4, "linear_num_value_heads": 4,
               "linear_num_key_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
               "linear_conv_kernel_dim": 4,
               "rope_parameters": {"type": "default", "rope_theta": 100000.0,
                                   "partial_rotary_factor": 0.25}},
    # Sliding window (RotatingKVCache, window 32 < generated length) + full attention,
    # per-layer inputs and KV sharing in the last two layers, as in Gemma 4 E2B/E4B.
    "gemma4": {**_COMMON, "model_type": "gemma4_text", "hidden_size": 128, "num_hidden_layers": 5,
               "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "global_head_dim": 64, "sliding_window": 32,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                               "sliding_attention", "full_attention"],
               "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
               "vocab_size_per_layer_input": VOCAB_SIZE, "final_logit_softcapping": 30.0},
    # MoE variant (router + experts beside the dense MLP, k == v on full attention),
    # as in Gemma 4 26B-A4B.
    "gemma4_moe": {**_COMMON, "model_type": "gemma4_text", "hidden_size": 128, "num_hidden_layers": 4,
                   "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "num_global_key_value_heads": 1, "attention_k_eq_v": True,
                   "head_dim": 32, "global_head_dim": 64, "sliding_window": 32,
                   "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                   "full_attention"],
                   "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
                   "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                   "moe_intermediate_size": 64, "final_logit_softcapping": 30.0},
}


# DFlash drafters for the fixtures (z-lab layout): 2 layers conditioned on target
# layers 1 and 3, block 8, the tokenizer's <|mask|> as mask token.
MASK_TOKEN_ID = SPECIAL_TOKENS.index("<|mask|>")
DFLASH = {name: {"architectures": ["DFlashDraftModel"], "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "head_dim": 32, "intermediate_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                 "max_position_embeddings": 4096, "block_size": 8, "vocab_size": VOCAB_SIZE,
                 "num_target_layers": FIXTURES[name]["num_hidden_layers"],
                 "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": MASK_TOKEN_ID}}
          for name in FIXTURES}


# EAGLE-3 drafters (speculators layout): features from the inputs of layers 1, 2, 3
# and a 512-token draft vocabulary (the targets' most frequent choices, mapped by d2t).
EAGLE3 = {name: {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
                 "draft_vocab_size": 512, "target_hidden_size": 128, "norm_before_residual": False,
                 "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
                 "transformer_layer_config": {"model_type": "llama", "hidden_size": 128, "num_attention_heads": 4,
                                              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
                                              "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                                              "max_position_embeddings": 4096, "vocab_size": VOCAB_SIZE},
                 "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": f"fixture:{name}"}}}
          for name in FIXTURES}


def fixture_names() -> list[str]:
    return sorted(FIXTURES)


def _file_hash(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def _spec_hash(name: str) -> str:
    blob = json.dumps({"spec": FIXTURES[name], "special": SPECIAL_TOKENS, "template": CHAT_TEMPLATE,
                       "weights": _file_hash(SHIPPED_DIR / f"{name}.safetensors"),
                       "tokenizer": _file_hash(SHIPPED_DIR / "tokenizer.json")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


# Quantized variants, `<fixture>-q4` / `<fixture>-q8`: mlx-lm's own quantization of the fixture,
# saved as mlx-lm's convert saves it (what most MLX users download). Drafters and the MTP head
# come from the original fixture, as they would from the original checkpoint.
QUANTIZED = {"q4": 4, "q8": 8}


def original(name: str) -> tuple[str, int | None]:
    """(the fixture a name is built from, its quantization bits or None)."""
    base, _, suffix = name.rpartition("-")
    return (base, QUANTIZED[suffix]) if base in FIXTURES and suffix in QUANTIZED else (name, None)


def fixture_dir(name: str) -> Path:
    """Path of the fixture checkpoint `name` (or its quantized variant), building it on first use."""
    base, bits = original(name)
    if base not in FIXTURES:
        raise KeyError(f"unknown fixture {name!r}; available: {', '.join(fixture_names())} "
                       f"(and each as -{' / -'.join(QUANTIZED)})")
    dest = home() / "fixtures" / f"{name}-{_spec_hash(base)}"
    if not (dest / "config.json").exists():
        build = None if bits is None else (lambda tmp: quantize_checkpoint(fixture_dir(base), tmp, bits))
        _build_atomically(name, dest, build)
    return dest


def quantize_checkpoint(src: Path, dest: Path, bits: int, group_size: int = 64) -> None:
    """`src` quantized with mlx-lm's quantize_model and saved as mlx_lm.convert saves it."""
    import mlx_lm
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, _ = mlx_lm.load(str(src))
    config = json.loads((src / "config.json").read_text())
    model, config = quantize_model(model, config, group_size=group_size, bits=bits)
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(src / f, dest / f)
    save_model(dest, model)
    save_config(config, dest / "config.json")


def drafter_dir(kind: str, name: str) -> Path:
    """Path of the fixture drafter `kind` (dflash) for fixture `name`, assembled on first use."""
    specs = {"dflash": DFLASH, "eagle3": EAGLE3}
    name = original(name)[0]  # a quantized variant drafts with its original's drafters
    if kind not in specs or name not in specs[kind]:
        raise KeyError(f"no {kind} drafter for fixture {name!r}; available: "
                       f"{', '.join(f'{k}:{n}' for k, v in specs.items() for n in v)}")
    weights = SHIPPED_DIR / f"{name}.{kind}.safetensors"
    blob = json.dumps({"spec": specs[kind][name], "weights": _file_hash(weights)}, sort_keys=True)
    dest = home() / "fixtures" / f"{name}.{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
    if not (dest / "config.json").exists():
        _build_atomically(f"{name}.{kind}", dest, lambda tmp: _write_drafter(specs[kind][name], weights, tmp))
    return dest


def _write_drafter(spec: dict, weights: Path, dest: Path) -> None:
    if not weights.exists():
        raise FileNotFoundError(f"{weights} is missing; create it with `python -m train.fixtures`")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(spec, indent=2))
    shutil.copyfile(weights, dest / "model.safetensors")


def _build_atomically(name: str, dest: Path, build=None) -> None:
    # Build in a sibling temp dir and rename: a crash never leaves half a checkpoint.
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        (build or (lambda d: build_checkpoint(name, d)))(tmp)
        try:
            tmp.rename(dest)
        except OSError:
            if not (dest / "config.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def corpus_text() -> str:
    """The fixtures' training text: harness/data/corpus.txt alone. It holds no benchmark prompt
    (not the built-in suite's, MT-Bench's or HumanEval's; tests/test_fixture_corpus.py checks),
    so fixture acceptance on those suites is measured on text the fixtures never saw."""
    return (DATA_DIR / "corpus.txt").read_text()


def train_tokenizer_json(path: Path) -> None:
    """Byte-level BPE over the project's own text, saved as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=1, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus_text().splitlines(), trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer training gave {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}: "
                           "the corpus in harness/data is too small")
    tok.save(str(path))


def write_tokenizer(dest: Path) -> None:
    """The shipped tokenizer.json plus the config files transformers reads."""
    shutil.copyfile(SHIPPED_DIR / "tokenizer.json", dest / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
              "eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "mask_token": "<|mask|>",
              "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (dest / "special_tokens_map.json").write_text(json.dumps(
        {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "mask_token")}, indent=2))


def build_model(name: str):
    """Instantiate fixture `name` with its seeded random weights (not saved)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    spec = FIXTURES[name]
    module = importlib.import_module(f"mlx_lm.models.{spec['model_type']}")
    mx.random.seed(SEED)
    model = module.Model(module.ModelArgs.from_dict(dict(spec)))
    # Re-draw matrices with one known scale; norms, gates and scalars keep mlx-lm's init.
    keys = iter(mx.random.split(mx.random.key(SEED), len(tree_flatten(model.parameters()))))
    params = []
    for path, p in tree_flatten(model.parameters()):
        k = next(keys)
        if p.ndim >= 2 and "conv1d" not in path:
            p = INIT_STD * mx.random.normal(p.shape, key=k)
        params.append((path, p))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def cast_model(model, dtype) -> None:
    """Cast floating parameters to `dtype`, except those the model keeps in its own
    precision (mlx-lm's cast_predicate, e.g. Qwen3.5's A_log), as mlx-lm's convert does."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    keep = getattr(model, "cast_predicate", lambda _: True)
    params = [(k, v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
              for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


def build_checkpoint(name: str, dest: Path) -> None:
    """Write fixture `name` to `dest` in the layout of a local Hugging Face checkout."""
    from mlx_lm.utils import save_config

    weights = SHIPPED_DIR / f"{name}.safetensors"
    if not weights.exists():
        raise FileNotFoundError(f"{weights} is missing; create it with `python -m train.fixtures {name}`")
    dest.mkdir(parents=True, exist_ok=True)
    write_tokenizer(dest)
    shutil.copyfile(weights, dest / "model.safetensors")
    save_config(dict(FIXTURES[name]), dest / "config.json")
