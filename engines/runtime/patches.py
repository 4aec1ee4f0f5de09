"""Every temporary change the harness makes to the libraries it measures, in one place.

The harness runs mlx-lm's models (and z-lab's DFlash reference) as they are. Where an engine
has to see inside a forward or route part of it elsewhere, it swaps one library attribute
for the duration of a call and puts the original object back on exit, also when the call
raises. The swapping happens here only: tests/test_patches.py checks that no other module of
engines/, harness/ or train/ assigns to a library module or class, and that each manager
restores exactly what it found. What gets swapped in (a kernel, a mask builder, a hook) stays
beside the feature that needs it; each manager takes `wrap`, a function from the original
object to its stand-in.

library target -> manager -> why -> who needs it
- mlx.nn.Linear.__call__ (the class attribute) -> `linear_call` -> 2-16-row matmuls on the
  few-row CUDA kernel, linears that share an input in one launch -> engines/kernels/gemm.py
  `small_m_linears`: multi-token target forwards (Target._feed) and the DFlash, EAGLE-3 and
  MTP drafters, when small_m_gemm is on (CUDA).
- `scaled_dot_product_attention` as imported by each mlx-lm model module -> `attention_function`
  -> attend over the cache's whole 256-key buffer, masked, so cuDNN plans once per bucket ->
  engines/runtime/dispatch.py `stable_attention`: multi-token target forwards when stable_attention is
  on (CUDA). Also -> one-token attention on a static buffer runs a kernel that reads the live
  length on the device (no mask: MLX's CUDA sdpa is unfused for any mask array) ->
  engines/kernels/live_attention.py `live_attention`: StaticTarget's steps on CUDA.
- `create_attention_mask` as imported by the decoder's mlx-lm module -> `attention_mask` ->
  the tree mask (each node sees the context and its ancestors) -> engines/runtime/tree.py
  `tree_attention`: Target.verify_tree (EAGLE-3's tree verify).
- each attention layer's `rope` (a module instance) -> `rope` -> one position per tree node
  -> engines/runtime/tree.py `tree_attention`, with the mask above.
- `gated_delta_update` as imported by the Qwen3.5 / Qwen3-Next modules -> `gated_delta_update`
  -> the fused CUDA recurrence, which can keep the state after every step for exact rollback
  -> engines/kernels/deltanet.py `RecurrenceHook`: every forward of a hybrid target (engines/runtime/cache.py
  Rollback).
- each GatedDeltaNet mixer's `conv1d` (a module instance) -> `conv1d` -> keep the conv's
  input, which rollback restores -> engines/kernels/deltanet.py `RecurrenceHook`, capture and
  recompute modes.
- entries of the decoder's layer list -> `decoder_layers` -> hand layer outputs to drafters,
  or queue the graph every few layers -> engines/runtime/hidden.py `hooked_layers` (`capture_hidden`:
  DFlash, EAGLE-3, MTP, train/; engines/runtime/dispatch.py `staged`).
- dflash.model_mlx.make_prompt_cache -> `zlab_make_prompt_cache` -> keep the caches its
  stream_generate makes, for the memory record -> engines/arms/external.py DFlashZlab.generate.
- dflash.model_mlx.snapshot_download -> `zlab_snapshot_download` -> its load_draft resolves a
  hub id; hand it the local directory -> engines/arms/external.py DFlashZlab (drafter loading).
- the decoder's layer list and the model's `_hidden_states`, after z-lab's stream_generate ->
  `zlab_layers_restored` -> stream_generate hooks the target's layers for good; no other arm
  may run through them -> engines/arms/external.py DFlashZlab.generate.

While held, a patch is process-wide (a module's or a class's attribute), so these assume one
forward at a time, which is how the loop runs them; the harness's only other threads
(engines/arms/outside.py's pipe readers) run no forwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Callable

import mlx.nn as nn


@contextmanager
def _swapped(owners: list, name: str, wrap: Callable):
    # owners[i].name = wrap(i, original) for the block; every original is put back, also
    # when the block or a wrap raises.
    originals = [getattr(o, name) for o in owners]
    try:
        for i, (o, f) in enumerate(zip(owners, originals)):
            setattr(o, name, wrap(i, f))
        yield
    finally:
        for o, f in zip(owners, originals):
            setattr(o, name, f)


def linear_call(wrap: Callable):
    """Replaces `mlx.nn.Linear.__call__` (the class attribute: every Linear instance, not its
    quantized subclasses) with wrap(original) for the block, then puts the original back.
    Why: engines/kernels/gemm.py routes few-row matmuls to its own CUDA kernel. The caller decides
    whether to nest (gemm.small_m_linears installs once)."""
    return _swapped([nn.Linear], "__call__", lambda _, f: wrap(f))


def attention_function(modules: list[ModuleType], wrap: Callable):
    """Replaces `scaled_dot_product_attention` in each of `modules` (mlx-lm model modules, whose
    attention classes call the name they imported from mlx_lm.models.base) with wrap(original);
    every module gets its own original back. A wrap may return the original to leave one as it
    is. Why: engines/runtime/dispatch.py's shape-stable attention (one cuDNN plan per cache bucket)."""
    return _swapped(modules, "scaled_dot_product_attention", lambda _, f: wrap(f))


def attention_mask(module: ModuleType, wrap: Callable):
    """Replaces `create_attention_mask` in `module` (the mlx-lm module of a decoder, which builds
    its masks by that name) with wrap(original), and restores it. Why: engines/runtime/tree.py's tree
    verify needs a mask of ancestors, which mlx-lm's causal builder cannot express."""
    return _swapped([module], "create_attention_mask", lambda _, f: wrap(f))


def rope(attentions: list[nn.Module], wrap: Callable):
    """Replaces the `rope` module of each attention layer (an instance attribute of mlx-lm's
    Attention modules) with wrap(original), and puts each original module back. Why:
    engines/runtime/tree.py places every tree node at its depth's position, not consecutively."""
    return _swapped(attentions, "rope", lambda _, r: wrap(r))


def gated_delta_update(modules: list[ModuleType], wrap: Callable):
    """Replaces `gated_delta_update` in each of `modules` (mlx-lm's qwen3_5 / qwen3_next, which
    call the name they imported from mlx_lm.models.gated_delta) with wrap(original), and
    restores each. Why: engines/kernels/deltanet.py's fused CUDA recurrence, which can also keep the
    state after every step (exact rollback of a hybrid target)."""
    return _swapped(modules, "gated_delta_update", lambda _, f: wrap(f))


def conv1d(mixers: list[nn.Module], wrap: Callable):
    """Replaces the `conv1d` module of each GatedDeltaNet mixer (an instance attribute) with
    wrap(original, slot), slot its index in `mixers`, and puts each original module back. Why:
    rollback restores a recurrent layer's conv state from the input its conv saw."""
    return _swapped(mixers, "conv1d", lambda slot, c: wrap(c, slot))


@contextmanager
def decoder_layers(layers: list, wrap: dict[int, Callable]):
    """Replaces entries of a decoder's layer list (the list object mlx-lm's model holds:
    engines/runtime/hidden.py `decoder(model).layers`) with wrap[i](layers[i]) for each i in `wrap`,
    and puts the original layer objects back. Why: drafters read layer outputs (capture_hidden),
    and staged dispatch queues the graph after some layers, without editing mlx-lm's models."""
    originals = {i: layers[i] for i in wrap}
    try:
        for i, w in wrap.items():
            layers[i] = w(originals[i])
        yield
    finally:
        for i, layer in originals.items():
            layers[i] = layer


def zlab_make_prompt_cache(zlab: ModuleType, wrap: Callable):
    """Replaces `make_prompt_cache` in z-lab's `dflash.model_mlx` (passed in: dflash is an
    optional extra) with wrap(original), and restores it. Why: its caches are local to its
    stream_generate; the DFlashZlab arm keeps them for the memory record."""
    return _swapped([zlab], "make_prompt_cache", lambda _, f: wrap(f))


def zlab_snapshot_download(zlab: ModuleType, wrap: Callable):
    """Replaces `snapshot_download` (huggingface_hub's, as `dflash.model_mlx` imported it) with
    wrap(original), and restores it. Why: its load_draft resolves a hub id through it; the
    DFlashZlab arm hands it the cell's local drafter directory instead."""
    return _swapped([zlab], "snapshot_download", lambda _, f: wrap(f))


@contextmanager
def zlab_layers_restored(model: nn.Module, layers: list):
    """Undoes what z-lab's stream_generate leaves in the target for good: on exit `layers` (the
    decoder's layer list, engines/runtime/hidden.py `decoder(model).layers`) holds the layer objects it
    held on entry, and the model no longer has the `_hidden_states` it marks. Why: no other
    arm of the cell may run through z-lab's layer hooks."""
    originals = list(layers)
    try:
        yield
    finally:
        layers[:] = originals
        if "_hidden_states" in model:  # mlx Modules keep list attributes as dict entries
            del model["_hidden_states"]
        model.__dict__.pop("_hidden_states", None)
