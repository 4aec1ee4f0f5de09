"""Where a method's output leaves the reference's, and whether that is a near-tie or a bug.

The reference arm's first output is the reference. Where a method leaves it, the
reference's own scores at that position are inspected (top-1/top-2 margin): a margin near
float noise is a numerical near-tie (bf16), a wide one with the method's token far down the
list is a bug. divergence_margin says where the scores come from.
"""

from __future__ import annotations

import mlx.core as mx

from engines.base import Engine
from harness.generation import Generation


def divergence(tokens: list[int], reference: list[int]) -> dict:
    """First index where `tokens` leaves `reference` (None if it never does)."""
    n = min(len(tokens), len(reference))
    first = next((i for i in range(n) if tokens[i] != reference[i]), None)
    if first is None and len(tokens) != len(reference):
        first = n
    matched = n if first is None else first
    return {"first_divergence": first, "matched_prefix": matched,
            "matched_fraction": matched / max(len(reference), 1)}


def divergence_margin(reference_arm: Engine, ref: Generation, ids: list[int], tokens: list[int], at: int) -> dict:
    """At the first divergence: the reference run's top-1/top-2 tokens and score margin,
    from the reference arm's own numbers: an external arm's log-probabilities where it
    gives them (mlx-lm's generate_step does; a log-probability margin is the logit
    margin), else the reference target re-run over the reference output (the harness's
    own arms), else recorded as unavailable. Never the method's target under the
    reference's name.

    A margin near float noise means the two runs split on a near-tie; a wide margin
    with the method's token far down the list means a bug.
    """
    reference = ref.tokens
    out = {"reference_token": reference[at] if at < len(reference) else None,
           "method_token": tokens[at] if at < len(tokens) else None}
    if at >= len(reference):
        return {**out, "margin_source": "unavailable: the reference output ended here"}
    if reference_arm.external:
        if at >= len(ref.scores):
            return {**out, "margin_source": f"unavailable: {reference_arm.name} gives no scores"}
        logits, source = ref.scores[at].reshape(-1).astype(mx.float32), f"{reference_arm.name} log-probabilities"
    else:
        logits = reference_arm.target.prefill(ids + reference[:at]).logits.astype(mx.float32)  # [V] for output position `at`
        source = "reference target re-run over the reference output"
    return {**out, **_margin(logits, tokens, at), "margin_source": source}


def _margin(logits: mx.array, tokens: list[int], at: int) -> dict:
    order = mx.argsort(-logits)
    rank = None
    if at < len(tokens):
        rank = int(mx.sum(logits > logits[tokens[at]]).item())
    top1, top2 = order[0].item(), order[1].item()
    return {"reference_top1": top1, "reference_top2": top2,
            "reference_margin": (logits[top1] - logits[top2]).item(), "method_token_rank": rank}
