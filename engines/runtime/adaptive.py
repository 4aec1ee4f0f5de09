"""Adaptive draft length: how many drafts a round makes, chosen per round instead of a fixed K.

Two rules, both lossless (the verify decides what is kept, whatever K was):
- a confidence threshold (method.draft_threshold): drafting stops before the first draft the
  drafter gives less than that probability (SpecDec++'s rule with the drafter's own confidence);
  `unsure` is its test, one host read per draft step.
- a bandit over K (method.draft_bandit, `KBandit`): UCB1 over K = 1..k_max, rewarded by the
  tokens a round yields per unit of its modelled cost. Engines never time, so the cost is a model:
  one target step plus K draft steps, each `draft_cost` of a target step (the drafter's weight bytes
  over the target's: batch-1 decoding reads every weight once a step).
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx.utils import tree_flatten


def unsure(logits: mx.array, token: mx.array, threshold: float) -> bool:
    """Whether the drafter gives its draft `token` ([1] id) less than `threshold` probability under its
    `logits` ([1, V]): one host read."""
    p = mx.softmax(logits[0].astype(mx.float32))[token[0]]
    return p.item() < threshold


def weight_bytes(model) -> int:
    """Bytes of a model's parameters as loaded (quantized parts at their packed size)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


class KBandit:
    """UCB1 over the draft length K in 1..k_max. Each K is tried once (longest first), then the K with
    the highest mean reward plus exploration bonus sqrt(2 ln t / n_K) is drafted. A round's reward is
    (accepted + 1) / (1 + K * draft_cost), over its best possible value (every draft accepted at the
    best K), so rewards lie in [0, 1] as UCB1's bound assumes. Deterministic: the same accepted counts
    give the same choices, so a cell's reps replay the same Ks."""

    def __init__(self, k_max: int, draft_cost: float):
        if k_max < 1 or not math.isfinite(draft_cost) or draft_cost < 0:
            raise ValueError(f"KBandit needs k_max >= 1 and a finite draft_cost >= 0; got {k_max}, {draft_cost}")
        self.k_max, self.draft_cost = k_max, draft_cost
        self.scale = max((k + 1) / (1 + k * draft_cost) for k in range(1, k_max + 1))
        self.reset()

    def reset(self) -> None:
        """Forget what was learned (a new generation starts from scratch, as every rep must)."""
        self.n = [0] * (self.k_max + 1)  # rounds drafted at each K (index 0 unused)
        self.total = [0.0] * (self.k_max + 1)
        self.t = 0

    def pick(self) -> int:
        """The K to draft this round."""
        for k in range(self.k_max, 0, -1):
            if not self.n[k]:
                return k
        log_t = math.log(self.t)
        return max(range(1, self.k_max + 1),
                   key=lambda k: (self.total[k] / self.n[k] + math.sqrt(2 * log_t / self.n[k]), k))

    def update(self, k: int, accepted: int) -> None:
        """Credit a round that drafted `k` and had `accepted` of them kept."""
        self.n[k] += 1
        self.total[k] += (accepted + 1) / (1 + k * self.draft_cost) / self.scale
        self.t += 1

    def describe(self) -> dict:
        return {"k_max": self.k_max, "draft_cost": round(self.draft_cost, 6)}
