"""Self-distilled training data: the target's own answers, generated in batches and cached.

Prompts come from `data.prompts` (a file) or, with none, from the target itself: Magpie
feeds an instruct model only its chat template's text up to where a user message starts
and lets it write the user's instruction. Every prompt is then rendered with the chat
template and answered by the target through mlx-lm's batch generation (greedy unless
data.temperature > 0). Rows are `prompt ids + answer ids` with a loss mask on the answer.

Cache layout (data.cache_dir, default <out>/data): manifest.json (what the rows depend on:
target, template, sampling, prompt source; a mismatch refuses reuse), prompts.jsonl, and
shard-NNNNN.jsonl files of data.batch rows each, every file written to a temp name and
renamed, so a kill leaves only whole shards and a rerun generates only the missing ones.

Before any answer is generated the prompts are checked against every evaluation suite the
harness ships or reads (built-in, MT-Bench, HumanEval): a training prompt equal to an
evaluation prompt, or sharing a 13-word run with one, is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.config import ConfigError

SENTINEL = "\u2063MAGPIE\u2063"  # a user message no template alters, to find where the message starts
STALL_ROUNDS = 3  # Magpie gives up after this many rounds in a row add no new instruction
NGRAM = 13  # the usual contamination test: a shared run of 13 normalised words
EVAL_SUITES = ("builtin", "mtbench", "humaneval")


@dataclass
class Rows:
    """Training rows: ids [prompt + answer] and how many of them are prompt."""

    ids: list[list[int]]
    prompt_lens: list[int]

    def answer_tokens(self) -> int:
        return sum(len(r) - p for r, p in zip(self.ids, self.prompt_lens))


# ---------------------------------------------------------------- prompts

def read_prompt_file(path: Path) -> list[str]:
    """User prompts from a .jsonl (prompt, instruction or turns[0] per line) or a text file (one per line)."""
    if not path.is_file():
        raise ConfigError(f"data.prompts={path} is not a file; pass a .jsonl or .txt of prompts, or null for Magpie")
    text = path.read_text(encoding="utf-8", errors="strict")
    if path.suffix != ".jsonl":
        return [line.strip() for line in text.splitlines() if line.strip()]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
        value = row.get("prompt") or row.get("instruction") or (row.get("turns") or [None])[0] \
            if isinstance(row, dict) else None
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{path}:{n}: no prompt (a string under prompt, instruction or turns[0])")
        out.append(value.strip())
    return out


def user_prefix(tokenizer) -> str:
    """The chat template's text before a user message (Magpie's pre-query template)."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise ConfigError("data.prompts=null asks the target to write its own instructions (Magpie), which needs a "
                          "chat template; this tokenizer has none: pass data.prompts=<file of prompts>")
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if SENTINEL not in text:
        raise ConfigError("the chat template drops the user message, so Magpie cannot find where it starts: "
                          "pass data.prompts=<file of prompts>")
    return text.split(SENTINEL, 1)[0]


def magpie_prompts(model, tokenizer, n: int, cfg, log, partial: Path | None = None) -> list[str]:
    """n distinct instructions (first lines of at least 3 words) the target writes after its
    template's user prefix; one that reaches magpie_max_tokens without ending is dropped."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    prefix = tokenizer.encode(user_prefix(tokenizer), add_special_tokens=False)
    out, rounds = [], 0
    if partial is not None and partial.exists():
        done = json.loads(partial.read_text())
        out, rounds = done["prompts"], done["rounds"]
        log(f"magpie: resumed at {len(out)}/{n} instructions (round {rounds})")
    seen, empty = {normalise(t) for t in out}, 0
    max_rounds = 4 * -(-n // cfg.batch) + 16  # each round offers 2x batch candidates; most are usually kept
    while len(out) < n and rounds < max_rounds and empty < STALL_ROUNDS:
        rounds += 1
        before = len(out)
        mx.random.seed(cfg.seed * 1009 + rounds)
        want = min(cfg.batch, n - len(out)) * 2
        res = batch_generate(model, tokenizer, [prefix] * want, max_tokens=cfg.magpie_max_tokens,
                             sampler=make_sampler(temp=cfg.magpie_temperature), return_token_ids=True)
        for text, ids in zip(res.texts, res.token_ids):
            finished = len(ids) < cfg.magpie_max_tokens or "\n" in text.strip()  # an end of turn, or of a line
            text = text.strip().split("\n", 1)[0].strip()  # Magpie's early stop: the first line
            key = normalise(text)
            if not finished or len(key.split()) < 3 or key in seen:
                continue
            seen.add(key)
            out.append(text)
        empty = 0 if len(out) > before else empty + 1  # rounds in a row that added nothing: it repeats itself
        if partial is not None:
            _write_atomic(partial, json.dumps({"rounds": rounds, "prompts": out}))
        log(f"magpie: {len(out)}/{n} instructions (round {rounds})")
    if len(out) < n:
        raise ConfigError(f"Magpie wrote {len(out)} usable instructions in {rounds} rounds, fewer than "
                          f"data.n_prompts={n}: lower it, raise data.magpie_max_tokens, or pass data.prompts")
    return out[:n]


# ---------------------------------------------------------------- overlap with evaluation suites

def normalise(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def _ngrams(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", normalise(text))
    return {tuple(words[i:i + NGRAM]) for i in range(len(words) - NGRAM + 1)}


def eval_texts() -> tuple[dict[str, list[str]], list[dict]]:
    """Every user turn of every evaluation suite the harness reads ({suite: turns}), and the
    suites' sources (file, sha256) for the record. A suite whose package is not installed is
    skipped and named in the sources with the reason."""
    from harness.prompts import load_suite, suite_sources

    texts, sources = {}, []
    for suite in EVAL_SUITES:
        try:
            texts[suite] = [t for p in load_suite(suite) for t in p.turns]
            sources += suite_sources(suite)
        except ConfigError as e:
            sources.append({"spec": suite, "skipped": str(e)})
    return texts, sources


def check_overlap(prompts: list[str], texts: dict[str, list[str]]) -> None:
    """ConfigError naming the first training prompt that equals an evaluation prompt or shares
    a 13-word run with one (training and evaluation prompts never overlap)."""
    exact = {normalise(t): s for s, ts in texts.items() for t in ts}
    grams = {g: s for s, ts in texts.items() for t in ts for g in _ngrams(t)}
    for i, p in enumerate(prompts):
        suite = exact.get(normalise(p)) or next((grams[g] for g in _ngrams(p) if g in grams), None)
        if suite:
            raise ConfigError(f"training prompt {i} ({p[:60]!r}...) overlaps the {suite} evaluation suite; remove it "
                              "from data.prompts (training and evaluation prompts must not overlap)")


# ---------------------------------------------------------------- answers, cached

def manifest(ckpt: Path, tokenizer, cfg, source: str) -> dict:
    """What the cached rows depend on; a cache whose manifest differs is not reused."""
    template = getattr(tokenizer, "chat_template", None) or ""
    config = (ckpt / "config.json").read_bytes() if (ckpt / "config.json").exists() else b""
    keys = ("n_prompts", "max_new_tokens", "temperature", "top_p", "magpie_temperature", "magpie_max_tokens",
            "batch", "seed")
    return {"target": str(ckpt), "target_config_sha256": hashlib.sha256(config).hexdigest(),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(), "prompt_source": source,
            **{k: getattr(cfg, k) for k in keys}}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _encode_prompt(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(prompt)


def build(model, tokenizer, ckpt: Path, cfg, cache: Path, log) -> tuple[Rows, dict]:
    """The rows (generating what the cache lacks) and the data part of the training record."""
    source = str(Path(cfg.prompts).resolve()) if cfg.prompts else "magpie"
    if cfg.prompts:
        source += ":" + hashlib.sha256("\n".join(read_prompt_file(Path(cfg.prompts))).encode()).hexdigest()[:16]
    want = manifest(ckpt, tokenizer, cfg, source)
    cache.mkdir(parents=True, exist_ok=True)
    have = json.loads((cache / "manifest.json").read_text()) if (cache / "manifest.json").exists() else None
    if have is not None and have != want:
        diff = [k for k in want if have.get(k) != want[k]]
        raise ConfigError(f"data cache {cache} was generated with other settings ({', '.join(diff)}); pass another "
                          "data.cache_dir or delete that directory to regenerate")
    _write_atomic(cache / "manifest.json", json.dumps(want, indent=2))
    prompts = _prompts(model, tokenizer, cfg, cache, log)
    texts, sources = eval_texts()
    check_overlap(prompts, texts)
    rows = _answers(model, tokenizer, prompts, cfg, cache, log)
    digest = hashlib.sha256()
    for f in sorted(cache.glob("shard-*.jsonl")):
        digest.update(f.read_bytes())
    info = {"cache": str(cache), "sha256": digest.hexdigest(), "rows": len(rows.ids), "prompt_source": source,
            "answer_tokens": rows.answer_tokens(), "overlap_checked": sources, **asdict(cfg)}
    return rows, info


def _prompts(model, tokenizer, cfg, cache: Path, log) -> list[str]:
    path = cache / "prompts.jsonl"
    if path.exists():
        return [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    if cfg.prompts:
        prompts = read_prompt_file(Path(cfg.prompts))
        random.Random(cfg.seed).shuffle(prompts)
        prompts = prompts[: cfg.n_prompts]
        if len(prompts) < cfg.n_prompts:
            log(f"data: {cfg.prompts} has {len(prompts)} prompts, fewer than data.n_prompts={cfg.n_prompts}")
    else:
        prompts = magpie_prompts(model, tokenizer, cfg.n_prompts, cfg, log, cache / "magpie.partial.json")
    _write_atomic(path, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (cache / "magpie.partial.json").unlink(missing_ok=True)
    return prompts


def _answers(model, tokenizer, prompts: list[str], cfg, cache: Path, log) -> Rows:
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    rows = Rows([], [])
    n_shards = -(-len(prompts) // cfg.batch)
    for s in range(n_shards):
        path = cache / f"shard-{s:05d}.jsonl"
        if not path.exists():
            part = prompts[s * cfg.batch:(s + 1) * cfg.batch]
            ids = [_encode_prompt(tokenizer, p) for p in part]
            mx.random.seed(cfg.seed * 100003 + s)  # a shard's sampled answers do not depend on the ones before
            res = batch_generate(model, tokenizer, ids, max_tokens=cfg.max_new_tokens, return_token_ids=True,
                                 sampler=make_sampler(temp=cfg.temperature, top_p=cfg.top_p))
            _write_atomic(path, "".join(json.dumps({"prompt_ids": p, "answer_ids": list(map(int, a))}) + "\n"
                                        for p, a in zip(ids, res.token_ids)))
            log(f"data: shard {s + 1}/{n_shards} answered ({sum(len(a) for a in res.token_ids)} tokens)")
        for line in path.read_text().splitlines():
            row = json.loads(line)
            p, a = row["prompt_ids"], row["answer_ids"]
            full = (p + a)[: cfg.max_len]
            if len(full) - len(p) >= 2:  # at least two answer tokens: something to predict after a draft
                rows.ids.append(full)
                rows.prompt_lens.append(len(p))
    if not rows.ids:
        raise ConfigError(f"no usable rows: every answer is shorter than 2 tokens within data.max_len={cfg.max_len}")
    return rows
