"""Prompt suites: the built-in suite and local JSONL files in the formats users have.

Accepted line formats (one JSON object per line):
- Spec-Bench question.jsonl: {"question_id": ..., "category": ..., "turns": [str, ...]}
- the dflash benchmark cache: {"turns": [str, ...]}
- plain: {"prompt": str} (optionally "id", "category")
The built-in suite (harness/data/prompts.jsonl) is itself in Spec-Bench format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.config import ConfigError

BUILTIN = Path(__file__).parent / "data" / "prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    turns: tuple[str, ...]  # user turns; turn j > 0 follows the reference answers to turns < j


def load_suite(spec: str, categories=(), max_prompts: int | None = None,
               per_category: int | None = None) -> list[Prompt]:
    """Prompts of `spec` ("builtin" or a .jsonl path), filtered (categories, then the first
    `per_category` of each, then the first `max_prompts`); raises ConfigError."""
    path = BUILTIN if spec == "builtin" else Path(spec).expanduser()
    prompts = _read_jsonl(path)
    if categories:
        known = sorted({p.category for p in prompts})
        missing = [c for c in categories if c not in known]
        if missing:
            raise ConfigError(f"bench.categories has {', '.join(missing)} not in {path}; "
                              f"its categories are: {', '.join(known)}")
        prompts = [p for p in prompts if p.category in categories]
    if per_category:
        prompts = _first_of_each_category(prompts, per_category)
    return prompts[:max_prompts] if max_prompts else prompts


def _first_of_each_category(prompts: list[Prompt], n: int) -> list[Prompt]:
    seen: dict[str, int] = {}
    kept = []
    for p in prompts:
        seen[p.category] = seen.get(p.category, 0) + 1
        if seen[p.category] <= n:
            kept.append(p)
    return kept


def _read_jsonl(path: Path) -> list[Prompt]:
    fix = "pass a readable .jsonl file with bench.suite=<path> (or bench.suite=builtin)"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"prompt file {path} does not exist; {fix}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"prompt file {path} cannot be read ({e.__class__.__name__}: {e}); {fix}") from None
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


def encode_turn(tokenizer, prompt: Prompt, turn: int, answers: list[str], chat_template: bool) -> list[int]:
    """Token ids of `prompt` up to user turn `turn`, earlier turns answered by `answers`."""
    messages = []
    for j in range(turn + 1):
        messages.append({"role": "user", "content": prompt.turns[j]})
        if j < turn:
            messages.append({"role": "assistant", "content": answers[j]})
    if chat_template and getattr(tokenizer, "has_chat_template", False):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return tokenizer.encode("\n\n".join(m["content"] for m in messages))
