"""Engines by name: a table of names to "module:Class", each module imported only when its
engine is asked for (lm-evaluation-harness's model mapping is the pattern).

Listing the names imports nothing, so the config can offer them without loading MLX, and
an engine module never has to import the registry back. Each class's `name` attribute is
its key here (tests/test_registry.py checks every entry).
"""

from __future__ import annotations

import importlib

ENGINES = {
    "base": "engines.autoregressive:Autoregressive",
    "control": "engines.control:Control",
    "dflash_a": "engines.dflash:DFlashA",
    "dflash_c": "engines.dflash:DFlashC",
    "dflash_zlab": "engines.external:DFlashZlab",
    "draft_model": "engines.draft_model:DraftModel",
    "eagle3": "engines.eagle3:Eagle3",
    "mlx_lm": "engines.external:MlxLm",
    "mlx_lm_spec": "engines.external:MlxLmSpec",
    "mtp": "engines.mtp:MTP",
    "ngram": "engines.ngram:Ngram",
    "server": "engines.outside:ServerArm",
    "subprocess": "engines.outside:SubprocessArm",
}

ALIASES = {
    "autoregressive": "base", "ar": "base",
    "verify_control": "control",
    "dflash": "dflash_a",
    "sps": "draft_model",
    "mlx-lm": "mlx_lm",
    "prompt_lookup": "ngram", "pld": "ngram",
    "zlab": "dflash_zlab",
}


def available() -> list[str]:
    return sorted(ENGINES)


def get_engine(name: str) -> type:
    """The engine class registered as `name` (or an alias); lists the others on a miss.
    Imports that engine's module only."""
    key = ALIASES.get(name, name)
    if key not in ENGINES:
        raise KeyError(f"unknown method {name!r}; available: {', '.join(available())}")
    module, cls = ENGINES[key].split(":")
    return getattr(importlib.import_module(module), cls)
