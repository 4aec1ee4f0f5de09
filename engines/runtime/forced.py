"""Forced acceptance: a round's accept decision replaced by a chosen one, everything else real.

A forced round drafts, verifies the same shapes and rolls back what it rejects exactly as a real
round does; only the accepted count comes from the setting instead of the comparison with the
target: `accepted=n` accepts min(n, K) drafts every round, `rate=p` accepts each position with
probability p given the one before (seeded, keyed by the output position, so a cell replays the
same counts). The accepted drafts are emitted as drafted, followed by the target's own token at
the first rejected position (its choice given those drafts, which the verify computed), as a real
accept of that length would, so the caches and every later round stay consistent.

What it is for: the cost of a method's round at a chosen acceptance, apart from how good its
drafter is (vLLM's synthetic acceptance rate, SGLang's simulated accept length, TensorRT-LLM's
forced accepted tokens). Its output is not the target's: a forced cell's divergence is expected
and it never passes a losslessness check.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from engines.runtime.sampling import Sampler, drafts_then
from engines.runtime.tree import tree_depths

STREAM = 4  # the Sampler key stream of forced accept draws (0-3 are the sampler's own)


@dataclass(frozen=True)
class Force:
    """accepted: drafts kept every round (capped at the round's K); rate: each position's chance,
    given the one before; exactly one is set. seed: the draws' seed (rate only)."""

    accepted: int | None = None
    rate: float | None = None
    seed: int = 0

    @staticmethod
    def from_config(cfg) -> "Force | None":
        """The method config's `force` block -> a Force, or None when neither field is set."""
        if cfg is None or (cfg.accepted is None and cfg.rate is None):
            return None
        return Force(cfg.accepted, cfg.rate, cfg.seed)

    def describe(self) -> dict:
        return {"accepted": self.accepted} if self.accepted is not None else {"rate": self.rate, "seed": self.seed}

    def count(self, k: int, pos) -> mx.array:
        """[1] int32: the drafts this round accepts out of k, for the round whose first output position
        is pos (an int, or a [] int32 device value in a round that stays on the device)."""
        if self.accepted is not None:
            return mx.array([min(self.accepted, k)], dtype=mx.int32)
        if k == 0:
            return mx.zeros((1,), dtype=mx.int32)
        u = mx.random.uniform(shape=(k,), key=_key(self.seed, pos))
        return mx.cumprod((u < self.rate).astype(mx.int32)).sum(keepdims=True).astype(mx.int32)

    def path(self, parents: list[int], pos) -> list[int]:
        """A tree round's forced path (node indices, root's child first): down the first child at
        each depth (the drafter's order), as deep as the count allows and that chain reaches: the
        walk engines/runtime/tree.py accept_tree_on_device takes with `forced`, so both executions agree."""
        want = int(self.count(max(tree_depths(parents), default=0), pos).item())
        path, here = [], -1
        while len(path) < want:
            child = next((i for i, p in enumerate(parents) if p == here), None)
            if child is None:
                break
            path.append(child)
            here = child
        return path


def accept_forced(tokens: mx.array, choices: mx.array, n: mx.array) -> mx.array:
    """The outcome of a forced accept, in accept_deterministic's layout: [n, emitted K+1], where
    emitted holds drafts tokens [K] up to n, then the target's choice at n (choices [K+1])."""
    final = mx.take(choices.astype(mx.int32), n)  # [1]
    return mx.concatenate([n.astype(mx.int32), drafts_then(tokens.astype(mx.int32), final, n)])


def _key(seed: int, pos) -> mx.array:
    return Sampler(0.0, seed).key(pos, STREAM)
