"""Drafters: one module per drafter kind (its network or model, config, load and save), found by kind.

`DRAFTERS` is the one list of kinds, shaped like engines/registry.py: listing it imports nothing, so
configs and train/ can name the kinds without loading MLX. Each entry says where a method finds its
drafter when `method.drafter` is null (`found`), and whether the fixtures ship one of that kind
(python -m train.fixtures). A method names its kind on its Engine class (`drafter_kind`); training
objectives for each kind live in train/ (train/__main__.py OBJECTIVES).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterKind:
    name: str
    # where a null method.drafter finds it: "own" (a directory in the kind's own layout: the fixture's or
    # the scale preset's, built beside it), "target" (tensors inside the target's own checkpoint), "model"
    # (a whole language model sharing the target's tokenizer)
    found: str
    fixture: bool  # the fixtures ship one (trained by python -m train.fixtures, in this table's order)

    @property
    def module(self) -> str:
        return f"engines.drafters.{self.name}"


DRAFTERS = {k.name: k for k in (DrafterKind("dflash", "own", True), DrafterKind("mtp", "target", True),
                                 DrafterKind("eagle3", "own", True), DrafterKind("draft_model", "model", False))}
KINDS = tuple(DRAFTERS)


def drafter_kind(kind: str) -> DrafterKind:
    if kind not in DRAFTERS:
        raise KeyError(f"unknown drafter kind {kind!r}; one of {', '.join(KINDS)}")
    return DRAFTERS[kind]


def drafter_module(kind: str):
    """The module of drafter `kind` (imports MLX)."""
    return importlib.import_module(drafter_kind(kind).module)
