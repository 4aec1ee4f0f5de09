"""The harness's GGUF import of the packaged SmolLM2-135M-Instruct Q4_1, checked against
readers nobody here wrote, on the same token ids:
- transformers' own GGUF loader (torch, float32): the same logits within float32 noise at
  every prompt position, the same greedy tokens, the same tokenization where llama.cpp's
  "smollm" digit pre-split does not matter (transformers' GGUF tokenizer lacks it);
- llama.cpp (llama-cpp-python, when installed; it computes with the Q4_1 weights and
  Q8_1 activations): logits within its quantization noise, and exactly its tokenization.

The comparison code is docs/benchmarks/2026-12-01-gguf-check/crosscheck.py; its README has
the full numbers on 10 MT-Bench and HumanEval prompts and sets up the venv this runs in
(torch, transformers, accelerate, gguf: none of them in the main venv, where this skips).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' GGUF loader requires accelerate")
pytest.importorskip("gguf", reason="transformers' GGUF loader reads the file with gguf-py")

from harness.errors import ConfigError  # noqa: E402
from harness.models.resolve import named_model_file  # noqa: E402
from harness.prompts import load_suite  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "2026-12-01-gguf-check" / "crosscheck.py"
PROMPTS = ("math-3", "multi_turn-3")  # built-in: digits, symbols and code-like text; a short plain one
GREEDY_TOKENS = 16
# Bounds from the README's 10 prompts (1,100 positions), with margin:
MAX_ABS_DLOGIT_TRANSFORMERS = 2e-3  # measured 1.8e-4 (logits span ~30-40 per position)
LLAMA_CPP = {"min_top1_rate": 0.9, "max_abs_dlogit": 5.0, "max_mean_abs_dlogit": 0.5}  # measured 0.98, 2.59, 0.19
# Where transformers' GGUF tokenizer differs (no digit pre-split: "\n    0" -> "\n   ", " ", "0") and llama.cpp not.
DIGIT_TEXT = 'def f(x):\n    """\n    >>> f(3.5)\n    0.5\n    """\n    return x - 3 + 1234567 * 0.25e-10'


def _crosscheck():
    spec = importlib.util.spec_from_file_location("gguf_crosscheck", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def checked():
    """(crosscheck module, rows of check_prompt over PROMPTS, our tokenizer, transformers' GGUF tokenizer,
    llama_cpp.Llama or None, prompts)."""
    try:
        named_model_file("smollm2")
    except ConfigError as e:
        pytest.skip(str(e))
    cc = _crosscheck()
    model, tokenizer, gguf_path = cc.load_harness()
    try:
        tf_model, tf_tok = cc.load_transformers(gguf_path)
    except (ValueError, ImportError, NotImplementedError) as e:  # a transformers without GGUF support for llama
        pytest.skip(f"transformers' GGUF loader cannot read {gguf_path.name}: {e}")
    llm = cc.load_llama_cpp(gguf_path)
    prompts = [p for p in load_suite("builtin") if p.id in PROMPTS]
    assert [p.id for p in prompts] == list(PROMPTS), "built-in prompt ids changed; pick two others"
    readers = {"harness": model, "transformers": tf_model, "llama.cpp": llm}
    rows = [cc.check_prompt(readers, tokenizer, p, greedy_tokens=GREEDY_TOKENS) for p in prompts]
    return cc, rows, tokenizer, tf_tok, llm, prompts


def test_smollm2_gguf_logits_match_transformers_gguf_loader(checked):
    _, rows, *_ = checked
    for row in rows:
        t = row["transformers"]
        assert t["top1_rate"] == 1.0, (
            f"{row['id']}: top-1 differs from transformers' GGUF reader at positions {t['disagree_positions']}")
        assert t["max_abs_dlogit"] < MAX_ABS_DLOGIT_TRANSFORMERS, (
            f"{row['id']}: max |dlogit| {t['max_abs_dlogit']:.3g} vs transformers' GGUF reader at position "
            f"{t['max_abs_at']} (bound {MAX_ABS_DLOGIT_TRANSFORMERS})")


def test_smollm2_gguf_greedy_tokens_match_transformers_generate(checked):
    _, rows, *_ = checked
    for row in rows:
        g = row["transformers"]["greedy"]
        assert g["first_divergence"] is None, f"{row['id']}: greedy tokens differ from transformers' generate: {g}"


def test_smollm2_gguf_tokenizer_matches_transformers_gguf_tokenizer(checked):
    cc, _, tokenizer, tf_tok, _, prompts = checked
    for p in prompts:
        row = cc.compare_tokens(tokenizer, lambda s: tf_tok.encode(s, add_special_tokens=False), p.turns[0])
        assert row["equal"], f"{p.id}: token ids differ from transformers' GGUF tokenizer: {row}"


def test_smollm2_gguf_logits_near_llama_cpp(checked):
    _, rows, _, _, llm, _ = checked
    if llm is None:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python: builds llama.cpp, ~13 min)")
    for row in rows:
        q = row["llama.cpp"]
        assert q["top1_rate"] >= LLAMA_CPP["min_top1_rate"], f"{row['id']}: top-1 vs llama.cpp {q}"
        assert q["max_abs_dlogit"] < LLAMA_CPP["max_abs_dlogit"], f"{row['id']}: max |dlogit| vs llama.cpp {q}"
        assert q["mean_abs_dlogit"] < LLAMA_CPP["max_mean_abs_dlogit"], f"{row['id']}: mean |dlogit| vs llama.cpp {q}"


def test_smollm2_gguf_tokenizer_matches_llama_cpp_digit_presplit(checked):
    cc, _, tokenizer, _, llm, prompts = checked
    if llm is None:
        pytest.skip("llama-cpp-python is not installed (pip install llama-cpp-python: builds llama.cpp, ~13 min)")
    for text in [DIGIT_TEXT, *cc.TOKENIZE_PROBES, *(p.turns[0] for p in prompts)]:
        row = cc.compare_tokens(tokenizer, lambda s: llm.tokenize(s.encode("utf-8"), add_bos=False, special=False),
                                text)
        assert row["equal"], f"token ids differ from llama.cpp's on {text!r}: {row}"
