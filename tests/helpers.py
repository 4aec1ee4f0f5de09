"""Test-only engines and runners (never registered, so never offered to users)."""

from __future__ import annotations

import random

from engines.base import Draft, Engine
from engines.methods.autoregressive import Autoregressive
from engines.runtime.sampling import Sampler
from engines.runtime.target import Target
from harness.generation import run_generation
from tests.conftest import engine_cfg


class Oracle(Engine):
    """Drafts the target's own greedy continuation (known in advance).

    With `corrupt`, one drafted token per round is replaced at a random index, so
    every acceptance length 0..K happens and partial rollbacks are exercised.
    """

    def __init__(self, target, k: int, continuation: list[int], prompt_len: int, corrupt: bool = False, seed=0):
        super().__init__(target, engine_cfg())
        self.k, self.continuation, self.prompt_len, self.corrupt = k, continuation, prompt_len, corrupt
        self.rng = random.Random(seed)

    def draft(self, history):
        pos = len(history) - self.prompt_len  # tokens generated so far; the next one is continuation[pos]
        tokens = list(self.continuation[pos: pos + self.k])
        if self.corrupt and tokens:
            i = self.rng.randrange(len(tokens) + 1)  # == len(tokens): leave this round intact
            if i < len(tokens):
                tokens[i] = (tokens[i] + 1) % self.target.vocab_size
        return Draft(tokens)


def generate_ids(engine: Engine, ids: list[int], n: int, temperature: float = 0.0, seed: int = 0):
    return run_generation(engine, ids, n, Sampler(temperature, seed))


def base_engine(model, **target_kw) -> Autoregressive:
    return Autoregressive(Target(model, **target_kw), engine_cfg(name="base"))


_BASE: dict = {}  # (id(model), prompt ids, n) -> (the model's weight arrays, base's greedy tokens)


def base_tokens(model, ids: list[int], n: int) -> list[int]:
    """Base decoding's greedy tokens (float32, default Target) for `ids`, computed once per model and
    prompt in a test session: the lossless tests compare many methods against the same base outputs.
    Kept only while the model holds the very weight arrays it was computed with (MLX arrays are
    immutable, so a model changed in place holds new ones and is decoded again)."""
    from mlx.utils import tree_flatten

    weights = [v for _, v in tree_flatten(model.parameters())]
    key = (id(model), tuple(ids), n)
    hit = _BASE.get(key)
    if hit is None or len(hit[0]) != len(weights) or any(a is not b for a, b in zip(hit[0], weights)):
        hit = _BASE[key] = (weights, generate_ids(base_engine(model), ids, n).tokens)
    return list(hit[1])


def same_cache_values(a, b) -> bool:
    """Cache entries written by two paths hold the same values: bit for bit on the CPU; on a GPU within
    1e-5 (its kernels pick their tiling, so the accumulation order, by shape: one token against a
    verify of several differs in the last bit: the H100 run of docs/benchmarks/2026-12-07-h100-static)."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return bool(mx.array_equal(a, b))
    return bool(mx.allclose(a, b, rtol=1e-5, atol=1e-5))
