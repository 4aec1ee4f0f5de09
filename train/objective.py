"""What every drafter objective shares: the frozen target's pass over a batch, padding, and
the interface train/loop.py drives (a trainable module, a loss with per-position accuracy,
an export the harness's loader reads back)."""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engines.runtime.hidden import (activation_dtype, capture_hidden, hidden_size, lm_head, num_layers, text_model,
                                    vocab_size)
from harness.errors import ConfigError
from train.quantize import dequantize_drafter


class Objective:
    """One drafting method's training objective over a frozen target.

    `module` is the trainable drafter (float32). `batch(rows, rng)` builds the step's inputs,
    running the target once (no gradient); `loss(module, batch)` returns (loss, metrics)
    where metrics["acc"] is [P] accuracy per draft position and metrics["n"] the positions
    counted. `export(module, out, dtype)` writes the drafter in its published layout and
    `load(out)` reads it back through the engine's own strict loader."""

    kind = ""
    positions = 1  # draft positions the accuracy curve covers

    @classmethod
    def check(cls, target: nn.Module, cfg) -> None:
        """Unsupported or ConfigError when this objective cannot train a drafter of cfg's shape for
        `target`: run as soon as the target loads, before any data is made or read, so a refusal
        leaves no data cache. Each objective adds the ids and sizes its drafter takes from the target."""

    def __init__(self, target: nn.Module, tokenizer, cfg):
        self.target, self.tokenizer, self.cfg = target, tokenizer, cfg
        self.n_layers, self.hidden, self.vocab = num_layers(target), hidden_size(target), vocab_size(target)
        self.args = text_model(target).args

    def arg(self, name: str, default=None):
        value = getattr(self.args, name, None)
        return default if value is None else value

    def head_dim(self) -> int:
        return self.arg("head_dim") or self.hidden // self.args.num_attention_heads

    def capture(self, ids: mx.array, layer_ids: tuple[int, ...]) -> tuple[list[mx.array], mx.array]:
        """The target's outputs of `layer_ids` ([B, T, H] each) and its logits [B, T, V], no gradient."""
        with capture_hidden(self.target, layer_ids) as sink:
            logits = self.target(ids)
        return [mx.stop_gradient(h.astype(mx.float32)) for h in sink], mx.stop_gradient(logits.astype(mx.float32))

    def batch(self, rows: list[list[int]], prompt_lens: list[int], rng: random.Random) -> dict:
        raise NotImplementedError

    def loss(self, module: nn.Module, batch: dict):
        raise NotImplementedError

    def export(self, module: nn.Module, out: Path, dtype) -> None:
        raise NotImplementedError

    def load(self, out: Path) -> nn.Module:
        raise NotImplementedError

    def describe(self) -> dict:
        """The drafter's shape for the training record."""
        return {}

    def adopt(self, theirs: dict) -> None:
        """Take over what a warm start's drafter fixes about the objective ({name: array}, before
        its weights are compared and loaded): nothing, unless the objective says otherwise."""

    def warm_start(self, src: Path) -> dict:
        """Set self.module's weights to the exported drafter at `src` (read through the engine's
        strict loader; a quantized export dequantized first) and return what the training record
        keeps of it. ConfigError naming train.init when it cannot be read (not safetensors, cut
        short, tensors missing), when its tensors differ from this drafter's in name or shape, or
        when an integer table differs that `adopt` did not take over: it was trained with other settings."""
        src = Path(src).expanduser()
        theirs, quantized = self._read_init(src)
        self.adopt(theirs)
        mine = dict(tree_flatten(self.module.parameters()))
        problem = _first_difference(mine, theirs)
        if problem:
            raise ConfigError(f"train.init={src}: {problem}; pass a drafter exported with these train.* settings and "
                              "data, or leave train.init null")
        self.module.load_weights([(k, v.astype(mine[k].dtype)) for k, v in theirs.items()])
        digest = hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
        return {"path": str(src), "quantized": quantized, "weights_sha256": digest}

    def _read_init(self, src: Path) -> tuple[dict, bool]:
        """({name: array}, quantized) of the drafter exported at `src`, or ConfigError naming train.init
        and what the loader said: a user's file, so whatever it holds is bad input, not a crash."""
        try:
            quantized = "quantization" in json.loads((src / "config.json").read_text(encoding="utf-8"))
            with tempfile.TemporaryDirectory() as tmp:
                path = src
                if quantized:
                    path = Path(tmp) / "float"
                    dequantize_drafter(src, path, mx.float32)
                weights = dict(tree_flatten(self.load(path).parameters()))
                mx.eval(weights)
        except ConfigError:
            raise
        except (OSError, ValueError, RuntimeError, KeyError, TypeError, AttributeError) as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise ConfigError(f"train.init={src}: not a readable {self.kind} drafter ({why}); pass a folder "
                              "`python -m train` exported, or leave train.init null") from None
        return weights, quantized


def layer_ids_within(ids, lo: int, hi: int, key: str) -> tuple[int, ...]:
    """`ids` as ints when each lies in lo..hi (the target's layers as `key` counts them); ConfigError
    naming `key` otherwise."""
    bad = [i for i in ids if not lo <= int(i) <= hi]
    if bad:
        raise ConfigError(f"{key}={list(ids)}: {bad} not among the target's layers {lo}..{hi}; leave it null for "
                          "the default spread")
    return tuple(int(i) for i in ids)


def _first_difference(mine: dict, theirs: dict) -> str | None:
    """What first tells two drafters' tensors apart ({name: array} each), or None."""
    for name in sorted(set(mine) | set(theirs)):
        if name not in theirs or name not in mine:
            return f"tensor {name} is {'missing from it' if name not in theirs else 'not in this drafter'}"
        a, b = mine[name], theirs[name]
        if a.shape != b.shape:
            return f"tensor {name} has shape {tuple(b.shape)}, this drafter's {tuple(a.shape)}"
        if not mx.issubdtype(a.dtype, mx.floating) and not mx.array_equal(a, b).item():
            return f"its integer table {name} differs from this drafter's"
    return None


def pad(rows: list[list[int]], prompt_lens: list[int]) -> tuple[mx.array, mx.array]:
    """ids [B, T] (right-padded with 0) and the answer mask [B, T] (1 on answer tokens)."""
    T = max(len(r) for r in rows)
    ids = mx.array([r + [0] * (T - len(r)) for r in rows], dtype=mx.int32)
    ans = mx.array([[p <= t < len(r) for t in range(T)] for r, p in zip(rows, prompt_lens)], dtype=mx.float32)
    return ids, ans


def shift(x: mx.array, k: int, fill=0) -> mx.array:
    """x[:, k:] right-padded back to x's length along axis 1 (position i holds i + k)."""
    if k == 0:
        return x
    tail = mx.full((x.shape[0], k, *x.shape[2:]), fill, dtype=x.dtype)
    return mx.concatenate([x[:, k:], tail], axis=1)


def soft_ce(logq: mx.array, p: mx.array) -> mx.array:
    """Cross-entropy of log-probabilities [..., V] against a teacher distribution [..., V] -> [...]."""
    return -(p * logq).sum(axis=-1)


def weighted_mean(x: mx.array, w: mx.array) -> mx.array:
    return (x * w).sum() / mx.maximum(w.sum(), 1e-9)


def target_head_rows(target: nn.Module, ids: mx.array) -> mx.array:
    """Rows `ids` of the target's output head as a [len(ids), H] float32 matrix (any head:
    tied, untied or quantized), read by applying the head to the identity."""
    h = hidden_size(target)
    cols = lm_head(target, mx.eye(h, dtype=mx.float32).astype(_dtype(target)), softcap=False)  # [H, V]
    return cols.T[ids].astype(mx.float32)


def _dtype(target):
    return activation_dtype(target)
