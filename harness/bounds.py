"""What a cell's sizes imply, checked before anything is timed, and the work they may cost.

A user's numbers decide how long a cell runs: a block size sets how many verify shapes the
calibration times, a prompt's length and the token budget set how many positions the model
must hold. Each is checked against what it implies (the token budget, the model's context)
and refused in one line with the numbers (ConfigError), or, for prompts and only when asked
(bench.truncate_prompts), cut from the left to fit. The calibration times a bounded set of
verify sizes whatever the block size, and interpolates between them.
"""

from __future__ import annotations

import math

from harness.errors import ConfigError

# The largest value each size may take: far past any real run, small enough that a typo (an extra
# digit, 1e20) is refused in one line instead of allocating for minutes (harness/config.py checks them).
MAX_NEW_TOKENS = 1 << 20  # tokens generated per prompt
MAX_REPS = 1000  # timed generations per arm and prompt
MAX_WARMUP = 100  # untimed generations per arm
MAX_CONTEXT = 1 << 22  # tokens of earlier conversation (a model's own positions bound it further)
MAX_BLOCK = 4096  # tokens verified in one round
MAX_TEMPERATURE = 100.0  # softmax temperature; far above, sampling is uniform noise
MAX_COUNT = 1_000_000  # prompts, categories, layers: counts of things that exist
WEEK_S = 7 * 24 * 3600  # timeouts

EVERY_SIZE_UP_TO = 16  # verify sizes timed one by one; real blocks (DFlash 16, EAGLE-3 trees) live here
GROWTH = 1.25  # beyond, each timed size is at least this much larger than the last


def verify_sizes(block: int) -> list[int]:
    """The verify sizes (tokens) the calibration times for a cell of `block`: every size up to
    16, then a geometric grid that always ends at `block` (35 sizes reach 1,000)."""
    sizes = list(range(1, min(block, EVERY_SIZE_UP_TO) + 1))
    while sizes[-1] < block:
        sizes.append(min(block, max(sizes[-1] + 1, math.ceil(sizes[-1] * GROWTH))))
    return sizes


def interpolate(table: dict[int, float], t: int) -> float:
    """table[t], or the straight line between the nearest timed sizes around t."""
    if t in table:
        return table[t]
    lo = max(k for k in table if k < t)
    hi = min(k for k in table if k > t)
    return table[lo] + (table[hi] - table[lo]) * (t - lo) / (hi - lo)


def nearest_at_or_above(sizes: list[int], t: int) -> int:
    """The first timed size >= t (a keep count is charged at the next timed shape)."""
    return next(s for s in sizes if s >= t)


def check_block(block_size: int | None, max_new_tokens: int) -> None:
    """A block larger than the token budget drafts tokens no round can emit."""
    if block_size is not None and block_size > max_new_tokens:
        raise ConfigError(f"method.block_size={block_size} is larger than bench.max_new_tokens={max_new_tokens}: a "
                          f"round verifies block_size tokens but the cell emits only {max_new_tokens}; lower "
                          "method.block_size or raise bench.max_new_tokens")


def positions_needed(prompt_tokens: int, max_new_tokens: int, block: int) -> int:
    # The last round may verify a whole block beyond the last token it keeps.
    return prompt_tokens + max_new_tokens + max(block - 1, 0)


def fit_prompt(ids: list[int], max_new_tokens: int, block: int, context: int | None, where: str,
               truncate: bool, first_fix: str = "") -> tuple[list[int], int | None]:
    """(ids, None) when the prompt fits the model's context with the budget and a block; else
    the last tokens that fit and the length they were cut from (truncate=True), or ConfigError
    (whose fix starts with `first_fix` when given)."""
    if context is None:
        return ids, None
    need = positions_needed(len(ids), max_new_tokens, block)
    if need <= context:
        return ids, None
    room = context - positions_needed(0, max_new_tokens, block)
    if not truncate or room < 1:
        fix = ("lower bench.max_new_tokens" if room < 1 else
               "shorten the prompt, lower bench.max_new_tokens, or set bench.truncate_prompts=true to keep its "
               f"last {room} tokens")
        fix = f"{first_fix}, {fix[0].lower()}{fix[1:]}" if first_fix else fix
        raise ConfigError(f"{where}: {len(ids)} prompt tokens + {max_new_tokens} new tokens + {max(block - 1, 0)} "
                          f"of a last block need {need} positions; the model holds {context} "
                          f"(max_position_embeddings); {fix}")
    return ids[-room:], len(ids)
