"""Library patches live in engines/runtime/patches.py only, and each one leaves the library as it found it.

Two claims: every context manager there puts back the very objects it replaced, on a clean
exit and when the block raises; and no other module of engines/, harness/ or train/ assigns
to a library module or class (read from source with `ast`, nothing imported).
"""

from __future__ import annotations

import ast
import inspect
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType

import mlx.nn as nn
import mlx_lm.models.llama as llama
import mlx_lm.models.qwen3 as qwen3
import mlx_lm.models.qwen3_5 as qwen3_5
import pytest

from engines.runtime import patches
from tests.conftest import REPO

LIBRARIES = ("mlx", "mlx_lm", "dflash")  # what the harness measures and must not edit in place
SCANNED = ("engines", "harness", "train")
HOME = Path("engines/runtime/patches.py")


# ---------------------------------------------------------------- every manager restores

def _stand_in(name: str, **attrs) -> ModuleType:
    # A module like z-lab's dflash.model_mlx (an optional extra, not installed everywhere).
    module = ModuleType(name)
    for k, v in attrs.items():
        setattr(module, k, v)
    return module


def _with(name: str, child) -> nn.Module:
    m = nn.Module()
    setattr(m, name, child)
    return m


def _model_with_layers(n: int) -> tuple[nn.Module, list]:
    model = nn.Module()
    model.layers = [nn.Linear(2, 2) for _ in range(n)]
    return model, model.layers


def _cases():
    """manager name -> (the context manager, a snapshot of what it may touch, what its body does).
    The snapshot reads each object the way the library reads it; the body changes what the
    library would change (only zlab_layers_restored's library does it from inside)."""
    attentions = [_with("rope", nn.RoPE(8)), _with("rope", nn.RoPE(8))]
    mixers = [_with("conv1d", nn.Conv1d(4, 4, 3, groups=4)), _with("conv1d", nn.Conv1d(4, 4, 3, groups=4))]
    zlab = _stand_in("dflash.model_mlx", make_prompt_cache=lambda model: [], snapshot_download=lambda repo_id, **kw: "")
    model, layers = _model_with_layers(3)
    wrapper = lambda f: lambda *a, **kw: f(*a, **kw)

    seen = []

    def first_only(f):  # wraps llama's, leaves qwen3's as it is (what a nested stable_attention does)
        seen.append(f)
        return wrapper(f) if len(seen) == 1 else f

    def z_lab_hooks():  # what its stream_generate leaves behind
        layers[1] = nn.Identity()
        model._hidden_states = [None]

    return {
        "linear_call": (lambda: patches.linear_call(wrapper), lambda: [vars(nn.Linear).get("__call__")], None),
        "attention_function": (
            lambda: patches.attention_function([llama, qwen3], first_only),
            lambda: [llama.scaled_dot_product_attention, qwen3.scaled_dot_product_attention], None),
        "attention_mask": (lambda: patches.attention_mask(llama, wrapper),
                           lambda: [llama.create_attention_mask, qwen3.create_attention_mask], None),
        "rope": (lambda: patches.rope(attentions, lambda r: nn.Identity()),
                 lambda: [a.rope for a in attentions] + [a["rope"] for a in attentions], None),
        "gated_delta_update": (lambda: patches.gated_delta_update([qwen3_5], wrapper),
                               lambda: [qwen3_5.gated_delta_update], None),
        "conv1d": (lambda: patches.conv1d(mixers, lambda c, slot: nn.Identity()),
                   lambda: [m.conv1d for m in mixers] + [m["conv1d"] for m in mixers], None),
        "decoder_layers": (lambda: patches.decoder_layers(layers, {0: lambda layer: nn.Identity(),
                                                                   2: lambda layer: nn.Identity()}),
                           lambda: [layers, *layers, model["layers"]], None),
        "zlab_make_prompt_cache": (lambda: patches.zlab_make_prompt_cache(zlab, wrapper),
                                   lambda: [zlab.make_prompt_cache], None),
        "zlab_snapshot_download": (lambda: patches.zlab_snapshot_download(zlab, wrapper),
                                   lambda: [zlab.snapshot_download], None),
        "zlab_layers_restored": (lambda: patches.zlab_layers_restored(model, layers),
                                 lambda: [layers, *layers, model["layers"], "_hidden_states" in model,
                                          "_hidden_states" in vars(model)], z_lab_hooks),
    }


def _managers() -> set[str]:
    return {name for name, f in vars(patches).items() if inspect.isfunction(f) and not name.startswith("_")
            and f.__module__ == patches.__name__}


def test_every_manager_in_engines_patches_has_a_restore_case():
    assert _managers() == set(_cases()), "add a case to _cases() for each new manager in engines/runtime/patches.py"


class _Planted(Exception):
    pass


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))  # the very objects (True, False: singletons)


@pytest.mark.parametrize("raises", [False, True], ids=["clean_exit", "body_raises"])
@pytest.mark.parametrize("name", sorted(_cases()))
def test_each_patch_swaps_for_the_block_and_restores_the_very_same_objects(name, raises):
    manager, snapshot, body = _cases()[name]
    before = snapshot()
    with pytest.raises(_Planted) if raises else nullcontext():
        with manager():
            if body is not None:
                body()
            assert not _same(snapshot(), before), f"{name} changed nothing inside its block"
            if raises:
                raise _Planted
    assert _same(snapshot(), before), f"{name} did not put back what it found"


def test_a_manager_restores_every_owner_when_a_wrap_raises_half_way():
    # attention_function over two modules whose second wrap fails: the first is put back too.
    before = [llama.scaled_dot_product_attention, qwen3.scaled_dot_product_attention]
    calls = []

    def wrap(f):
        calls.append(f)
        if len(calls) == 2:
            raise _Planted
        return lambda *a: f(*a)

    with pytest.raises(_Planted):
        with patches.attention_function([llama, qwen3], wrap):
            pass
    assert _same([llama.scaled_dot_product_attention, qwen3.scaled_dot_product_attention], before)


# ---------------------------------------------------------------- no patch outside engines/runtime/patches.py

def _library_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted library object, for every import of a library anywhere in a file
    (`import mlx.nn as nn`: nn -> mlx.nn; `from mlx_lm.models.cache import KVCache`: KVCache ->
    mlx_lm.models.cache.KVCache)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in LIBRARIES:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _resolve(node: ast.AST, names: dict[str, str]) -> str | None:
    """The library object an expression names (nn.Linear -> mlx.nn.Linear), or None."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, names)
        return f"{owner}.{node.attr}" if owner else None
    return None


def swapped_names(home: Path = REPO / HOME) -> set[str]:
    """The attribute names engines/runtime/patches.py swaps (the second argument of each `_swapped` call)."""
    return {c.args[1].value for c in ast.walk(ast.parse(home.read_text())) if isinstance(c, ast.Call)
            and isinstance(c.func, ast.Name) and c.func.id == "_swapped" and len(c.args) > 1
            and isinstance(c.args[1], ast.Constant)}


def _stores(tree: ast.AST):
    """(owner expression, attribute name, line) of every attribute assignment or deletion, and
    of every setattr/delattr call with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            yield node.value, node.attr, node.lineno  # Assign, AugAssign, AnnAssign, for-targets, del
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
              and len(node.args) >= 2):
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else "<computed>"
            yield node.args[0], name, node.lineno


def library_patches(path: Path, swapped: set[str]) -> list[str]:
    """'line: what' for each assignment in `path` that edits a library in place: to an attribute
    of a library module or class (resolved through the file's imports), or of anything but
    `self` under a name engines/runtime/patches.py swaps (the owner of those is found at run time:
    sys.modules, a model's layers)."""
    tree = ast.parse(path.read_text(), str(path))
    names = _library_names(tree)
    out = []
    for owner, attr, line in sorted(_stores(tree), key=lambda store: store[2]):
        lib = _resolve(owner, names)
        mine = isinstance(owner, ast.Name) and owner.id == "self"
        if lib is not None:
            out.append(f"{line}: {lib}.{attr}")
        elif attr in swapped and not mine:
            out.append(f"{line}: {ast.unparse(owner)}.{attr} (a name engines/runtime/patches.py swaps)")
    return out


def scan(root: Path = REPO, swapped: set[str] | None = None) -> list[str]:
    swapped = swapped_names() if swapped is None else swapped
    return [f"{path.relative_to(root)}:{hit}" for top in SCANNED for path in sorted((root / top).rglob("*.py"))
            if path.relative_to(root) != HOME for hit in library_patches(path, swapped)]


def test_no_module_but_engines_patches_assigns_to_a_library_module_or_class():
    found = scan()
    assert not found, (f"library code patched outside engines/runtime/patches.py: {found}; add a context manager "
                       "there (with a docstring: what it replaces, why, what it restores) and call it")


def test_patches_swaps_the_names_the_check_watches():
    assert swapped_names() == {"__call__", "scaled_dot_product_attention", "create_attention_mask", "rope",
                               "gated_delta_update", "conv1d", "make_prompt_cache", "snapshot_download"}


def test_the_check_catches_planted_patches_and_spares_the_project_own_attributes(tmp_path):
    planted = '''
import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.llama as llama
from mlx_lm.models.cache import KVCache
from mlx_lm.models import gated_delta as gd
import sys


class Engine:
    def __init__(self, model, zlab):
        self.rope = None                                  # its own attribute: fine
        self.zlab = zlab
        self.zlab.make_prompt_cache = list                # PATCH: z-lab, owner found at run time
        model.config.offset = 3                           # an object's state: fine


def f(layers, mods, cache, tok):
    nn.Linear.__call__ = lambda self, x: x                # PATCH: class attribute
    llama.create_attention_mask = None                    # PATCH: module attribute
    KVCache.update_and_fetch = None                       # PATCH: class imported from mlx_lm
    gd.gated_delta_update += 0                            # PATCH: augmented
    setattr(mx.fast, "rope", None)                        # PATCH: setattr on a library module
    del nn.RoPE.__call__                                  # PATCH: deletion
    for m in mods:
        m.scaled_dot_product_attention = None             # PATCH: owner from a list
    sys.modules["x"].conv1d = None                        # PATCH: a swapped name
    cache.offset = 4                                      # a cache's state: fine
    tok.eos_token_ids = {1}                               # an instance's state: fine
    layers[0].self_attn.stable = True                     # fine
    setattr(cache, "keys", None)                          # fine
'''
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "planted.py").write_text(planted)
    (tmp_path / "engines" / "runtime").mkdir()
    (tmp_path / HOME).write_text("import mlx.nn as nn\nnn.Linear.__call__ = None\n")
    found = scan(tmp_path, swapped_names())
    lines = [n for n, text in enumerate(planted.splitlines(), start=1) if "# PATCH" in text]
    assert [int(hit.split(":")[1]) for hit in found] == lines, found
    assert all(hit.startswith("engines/planted.py:") for hit in found), "engines/runtime/patches.py itself is exempt"
