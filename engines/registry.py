"""Engines by name: a table of names to "module:Class", each module imported only when its
engine is asked for (lm-evaluation-harness's model mapping is the pattern).

Listing the names imports nothing, so the config can offer them without loading MLX, and
an engine module never has to import the registry back. Each class's `name` attribute is
its key here (tests/test_registry.py checks every entry).
"""

from __future__ import annotations

import importlib

ENGINES = {
    "base": "engines.methods.autoregressive:Autoregressive",
    "control": "engines.methods.control:Control",
    "dflash_a": "engines.methods.dflash:DFlashA",
    "dflash_c": "engines.methods.dflash:DFlashC",
    "dflash_zlab": "engines.arms.external:DFlashZlab",
    "ddtree": "engines.methods.ddtree:DDTree",
    "draft_model": "engines.methods.draft_model:DraftModel",
    "eagle3": "engines.methods.eagle3:Eagle3",
    "mlx_lm": "engines.arms.external:MlxLm",
    "mlx_lm_spec": "engines.arms.external:MlxLmSpec",
    "mtp": "engines.methods.mtp:MTP",
    "ngram": "engines.methods.ngram:Ngram",
    "server": "engines.arms.outside:ServerArm",
    "subprocess": "engines.arms.outside:SubprocessArm",
    "suffix": "engines.methods.suffix:Suffix",
}

# The same methods with rounds that stay on the device (engines/methods/device.py), for execution=static.
STATIC = {
    "base": "engines.methods.device:StaticBase",
    "ngram": "engines.methods.ngram:NgramStatic",
    "draft_model": "engines.methods.draft_model:DraftModelStatic",
    "eagle3": "engines.methods.eagle3:Eagle3Static",
    "dflash_a": "engines.methods.dflash:DFlashAStatic",
    "mtp": "engines.methods.mtp:MTPStatic",
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


def get_engine(name: str, execution: str = "eager") -> type:
    """The engine class registered as `name` (or an alias); lists the others on a miss.
    With execution="static", its device-resident class where one exists (has_static says), else
    the eager one. Imports that engine's module only."""
    key = ALIASES.get(name, name)
    if key not in ENGINES:
        raise KeyError(f"unknown method {name!r}; available: {', '.join(available())}")
    module, cls = (STATIC[key] if execution == "static" and key in STATIC else ENGINES[key]).split(":")
    return getattr(importlib.import_module(module), cls)


def has_static(name: str) -> bool:
    """Whether method `name` has a device-resident engine (execution=static)."""
    return ALIASES.get(name, name) in STATIC
