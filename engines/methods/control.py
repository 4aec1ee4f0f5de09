"""Control: an empty draft pushed through the batched verify path.

Each round feeds [pending] + K filler tokens in one target forward, exactly the
shape a K-draft method verifies, but uses only the first position and rolls the
fillers back. In exact arithmetic this is base decoding; any divergence from base
is therefore the verify kernel's numerics (batched vs single-token forward), never
a method bug. Compare a method's divergence with the control's at the same block
size to tell the two apart.
"""

from __future__ import annotations

import mlx.core as mx

from engines.base import Draft, Engine


class Control(Engine):
    name = "control"
    knobs = ("block_size",)
    drafts = False  # it keeps one token per round, so the loop pipelines it like base decoding
    verifies_full_block = True  # every round costs a K+1 verify though it drafts nothing

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        self.fillers = cfg.block_size - 1

    def verify(self, pending: mx.array, draft: Draft):
        # [1 + K fillers] -> logits [K+1, V]; the loop sees only position 0 (empty draft).
        return self.target.verify(mx.repeat(pending, 1 + self.fillers)).logits[:1]

    def rollback(self, n_accepted: int, draft: Draft) -> None:
        self.target.commit(1)
