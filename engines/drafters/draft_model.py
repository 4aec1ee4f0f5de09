"""The draft model: a whole small language model sharing the target's tokenizer (any mlx-lm
checkpoint, GGUF file, fixture or packaged model), loaded in the target's activation dtype, with the
tensors it shares with its target filled in where it ships without them (engines/runtime/shared_weights.py).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from engines.errors import DrafterError
from engines.home import home
from engines.runtime import shared_weights
from engines.runtime.checkpoint import float_drafter
from engines.runtime.hidden import activation_dtype, vocab_size
from engines.runtime.target import Target


def load_draft_model(path: Path, target: Target):
    """The mlx-lm model at `path` in the target's activation dtype; DrafterError when its
    vocabulary is not the target's (a draft model must share the target's tokenizer)."""
    from mlx_lm.utils import load_model

    path = Path(path)
    if not (path / "config.json").is_file():
        raise DrafterError(f"{path} is not a model directory (no config.json); method.drafter for draft_model "
                           "is a model: a checkpoint dir, a GGUF file, fixture:<name> or a packaged model name")
    if shared_weights.shares_tensors(path):  # shipped without the embedding it shares with the target
        path = shared_weights.materialize(path, target.model, home())
    model, config = load_model(path)
    if vocab_size(model) != target.vocab_size:
        raise DrafterError(f"draft model {path} has a vocabulary of {vocab_size(model)}, the target "
                           f"{target.vocab_size}: "
                           "a draft model must share the target's tokenizer")
    model.set_dtype(activation_dtype(target.model))
    model.eval()
    float_drafter(model, activation_dtype(target.model))
    mx.eval(model.parameters())
    return model, config
