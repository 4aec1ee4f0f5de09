"""Library patches in engines/patches.py leave the library as they found it.

Every context manager there puts back the very objects it replaced, on a clean exit and when
the block raises.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from types import ModuleType

import mlx.nn as nn
import mlx_lm.models.llama as llama
import mlx_lm.models.qwen3 as qwen3
import mlx_lm.models.qwen3_5 as qwen3_5
import pytest

from engines import patches


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
    assert _managers() == set(_cases()), "add a case to _cases() for each new manager in engines/patches.py"


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
