"""The engine registry: names to "module:Class", loaded on demand (engines/registry.py)."""

import subprocess
import sys

import pytest

from engines.base import Engine
from engines.registry import ALIASES, ENGINES, available, get_engine
from tests.conftest import REPO

# The aliases as the @register decorators declared them before the table replaced them.
ALIASES_BEFORE = {"autoregressive": "base", "ar": "base", "verify_control": "control", "dflash": "dflash_a",
                  "sps": "draft_model", "mlx-lm": "mlx_lm", "prompt_lookup": "ngram", "pld": "ngram",
                  "zlab": "dflash_zlab"}


@pytest.mark.parametrize("key", sorted(ENGINES))
def test_every_table_entry_loads_an_engine_class_named_by_its_key(key):
    cls = get_engine(key)
    assert isinstance(cls, type) and issubclass(cls, Engine), f"{ENGINES[key]} is not an Engine subclass"
    assert cls.name == key, f"{ENGINES[key]}.name is {cls.name!r}, but the registry lists it as {key!r}"


def test_aliases_resolve_to_the_same_classes_as_before():
    assert ALIASES == ALIASES_BEFORE
    for alias, key in ALIASES_BEFORE.items():
        assert get_engine(alias) is get_engine(key), alias


def test_an_unknown_name_fails_listing_every_available_engine():
    with pytest.raises(KeyError) as e:
        get_engine("x")
    assert e.value.args[0] == f"unknown method 'x'; available: {', '.join(sorted(ENGINES))}"
    assert available() == sorted(ENGINES)


def _modules_loaded_after(code: str) -> set[str]:
    # A fresh interpreter: this process has already imported every engine.
    out = subprocess.run([sys.executable, "-c", f"import sys\n{code}\nprint(' '.join(sys.modules))"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_listing_names_imports_no_engine_and_asking_for_one_imports_only_its_module():
    engine_modules = {spec.split(":")[0] for spec in ENGINES.values()}
    assert not engine_modules & _modules_loaded_after("from engines.registry import available; available()")
    loaded = _modules_loaded_after("from engines.registry import get_engine; get_engine('ngram')")
    assert loaded & engine_modules == {"engines.methods.ngram"}
