"""Base autoregressive decoding: the decode loop with an empty draft.

Every round verifies just the pending token, so a round is one single-token decode
step and nothing is ever rolled back.
"""

from engines.base import Engine, register


@register("base", "autoregressive", "ar")
class Autoregressive(Engine):
    pass
