"""Reading a target's internals without editing mlx-lm: layer outputs, embeddings, lm_head.

Drafters (DFlash, EAGLE-3, MTP) condition on the target's hidden states. They are
captured by swapping hooks into the decoder's layer list for the duration of one
forward (`capture_hidden`) and always swapping the original layers back, so no
patched class or module outlives the call (the swap: engines/runtime/patches.py `decoder_layers`).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from engines.runtime.patches import decoder_layers


def text_model(model: nn.Module) -> nn.Module:
    """The causal LM inside a multimodal wrapper (`model.language_model`: gemma4, qwen3_5's
    VL form), or the model itself: the module that owns `lm_head`, `args` and the decoder."""
    inner = getattr(model, "language_model", None)
    return inner if isinstance(inner, nn.Module) else model


def decoder(model: nn.Module) -> nn.Module:
    """The inner model holding `embed_tokens` and the real `layers` list, for every mlx-lm
    family: `model.model` (llama, qwen2/3, mistral, gemma4_text, ...) or
    `model.language_model.model` (multimodal wrappers).

    Hooks must go into this list: qwen3_5's `model.layers` is a fresh slice on every access.
    """
    for owner in (model, text_model(model)):
        inner = getattr(owner, "model", None)
        if inner is not None and isinstance(getattr(inner, "layers", None), list) and hasattr(inner, "embed_tokens"):
            return inner
    raise TypeError(f"{type(model).__name__}: cannot find the decoder's layer list "
                    "(model.model.layers or model.language_model.model.layers)")


def num_layers(model: nn.Module) -> int:
    return len(decoder(model).layers)


def embed_tokens(model: nn.Module) -> nn.Module:
    return decoder(model).embed_tokens


def vocab_size(model: nn.Module) -> int:
    """Rows of the token embedding (a quantized embedding packs its columns, never its rows)."""
    e = embed_tokens(model)
    return getattr(e, "num_embeddings", None) or e.weight.shape[0]


def hidden_size(model: nn.Module) -> int:
    """Width of the embedding as the model computes with it (not its packed storage width)."""
    e = embed_tokens(model)
    return getattr(e, "dims", None) or e.weight.shape[-1]


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the target computes in: what its embedding returns (scales of a quantized one)."""
    e = embed_tokens(model)
    return getattr(e, "scales", e.weight).dtype


class _Hook:
    """Stands in for one decoder layer: calls it and hands its output hidden state to `seen`."""

    def __init__(self, layer, seen):
        self._layer, self._seen = layer, seen

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        self._seen(out[0] if isinstance(out, tuple) else out)  # gemma4 layers return tuples
        return out

    def __getattr__(self, name):  # is_linear, layer_type, ... as the model expects
        return getattr(self._layer, name)


@contextmanager
def hooked_layers(model: nn.Module, seen: dict):
    """Within the block, decoder layer i hands every output hidden state [B, T, H] to
    seen[i]; the original layers are always put back (engines/runtime/patches.py `decoder_layers`)."""
    with decoder_layers(decoder(model).layers, {i: partial(_Hook, seen=fn) for i, fn in seen.items()}):
        yield


@contextmanager
def capture_hidden(model: nn.Module, layer_ids: tuple[int, ...]):
    """Within the block, forwards record the outputs of `layer_ids`: sink[i] is [B, T, H]."""
    sink: list = [None] * len(layer_ids)

    def keep(lid):
        slots = [s for s, i in enumerate(layer_ids) if i == lid]  # a layer id listed twice fills both

        def put(h):
            for slot in slots:
                sink[slot] = h
        return put

    with hooked_layers(model, {lid: keep(lid) for lid in dict.fromkeys(layer_ids)}):
        yield sink


def embed(model: nn.Module, ids: mx.array) -> mx.array:
    """Token embeddings as the target's first layer sees them ([..., H])."""
    inner = decoder(model)
    h = inner.embed_tokens(ids)
    scale = getattr(inner, "embed_scale", None)  # gemma scales embeddings by sqrt(hidden)
    return h * scale if scale is not None else h


def lm_head(model: nn.Module, h: mx.array, softcap: bool = True) -> mx.array:
    """The target's output head on hidden states (after its final norm): [..., V], with the
    target's own logit soft-capping unless `softcap` is False (DFlash drafters cap their own)."""
    lm = text_model(model)
    head = getattr(lm, "lm_head", None)
    logits = head(h) if head is not None else decoder(model).embed_tokens.as_linear(h)
    cap = getattr(lm, "final_logit_softcapping", None)
    if cap and softcap:
        logits = mx.tanh(logits / cap) * cap
    return logits


def final_norm(model: nn.Module, h: mx.array) -> mx.array:
    return decoder(model).norm(h)
