"""Base autoregressive decoding: the decode loop with an empty draft.

Every round verifies just the pending token, so a round is one single-token decode
step and nothing is ever rolled back; the loop queues each step before reading the
previous token (harness/loop.py), the way mlx-lm's own generate_step runs.
"""

from engines.base import Engine


class Autoregressive(Engine):
    name = "base"
    drafts = False  # the loop pipelines its steps as mlx-lm's generate_step does

    def verify(self, pending, draft):
        return self.target.forward(pending).logits  # one token, never rolled back: no rollback bookkeeping

    def rollback(self, n_accepted, draft):
        pass
