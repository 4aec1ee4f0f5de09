"""What batching buys base decoding on this machine, before the harness has a batch axis (issue 54):
mlx-lm's BatchGenerator at B = 1, 2, 4, 8 rows against the same B prompts decoded one by one with
mlx-lm's generate_step, interleaved over reps in one process. One JSON line per B.

    python jobs/batch_probe.py [--model smollm2] [--dtype float32] [--tokens 64] [--reps 3] [--batches 1 2 4 8]

The prompts are bench=real's (MT-Bench writing and HumanEval, chat-templated), the first B of them.
BatchGenerator runs with completion and prefill batch sizes of B (its defaults, 32 and 8, are for a
server; here every row is inserted at once) and no stop token, so every row decodes `--tokens`.
Aggregate tok/s = all rows' decoded tokens (after each row's first) over the wall time from the first
generated token to the last; one by one, the same over the sum of the rows' decode times. Rows are
compared with their one-by-one tokens (`rows_equal`): a batched matmul may round differently.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from harness import blas

blas.select()

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402

from harness.env import environment  # noqa: E402
from harness.errors import ConfigError  # noqa: E402
from harness.faults import guarded  # noqa: E402
from harness.models.load import load_target  # noqa: E402
from harness.models.resolve import resolve_model  # noqa: E402
from harness.prompts import encode_turn, load_suite  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_env import emit  # noqa: E402


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    """The first n turn-0 prompts of bench=real's suite, as the harness encodes them."""
    found = load_suite("mtbench+humaneval", categories=["writing", "humaneval"], per_category=max(n, 4))
    ids = [encode_turn(tokenizer, p, 0, [], True, ()) for p in found]
    if len(ids) < n:
        raise ConfigError(f"--batches asks for {n} prompts; the suite gave {len(ids)}")
    return ids[:n]


def one_by_one(model, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """(decode seconds summed over rows, each row's tokens): generate_step per prompt, greedy."""
    total, out = 0.0, []
    for p in prompts:
        gen, row = generate_step(mx.array(p), model, max_tokens=tokens), []
        for i, (tok, _) in enumerate(gen):
            if i == 0:
                t0 = time.perf_counter()  # decode time starts at the first token, as the harness's does
            row.append(int(tok))
        total += time.perf_counter() - t0
        out.append(row)
    return total, out


def batched(model, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    """(wall seconds from the first generated token to the last, each row's tokens): one BatchGenerator."""
    b = len(prompts)
    gen = BatchGenerator(model, max_tokens=tokens, completion_batch_size=b, prefill_batch_size=b)
    uids = gen.insert(prompts, [tokens] * b)
    rows: dict[int, list[int]] = {u: [] for u in uids}
    t0 = None
    while responses := gen.next_generated():
        if t0 is None:
            t0 = time.perf_counter()
        for r in responses:
            rows[r.uid].append(int(r.token))
    seconds = time.perf_counter() - t0
    gen.close()
    return seconds, [rows[u] for u in uids]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.tokens < 2 or a.reps < 1 or min(a.batches) < 1 or max(a.batches) > 64:
        raise ConfigError("--tokens >= 2, --reps >= 1, --batches in 1..64")
    model, tokenizer = load_target(resolve_model(a.model, a.dtype), a.dtype)
    every = prompts_for(tokenizer, max(a.batches))
    for b in a.batches:
        prompts = every[:b]
        batched(model, prompts, 4), one_by_one(model, prompts[:1], 4)  # warm-up: kernels, buffers
        seq_s, bat_s = [], []
        for _ in range(a.reps):  # interleaved: the machine's drift falls on both arms
            s, seq_rows = one_by_one(model, prompts, a.tokens)
            seq_s.append(s)
            s, bat_rows = batched(model, prompts, a.tokens)
            bat_s.append(s)
        decoded = b * (a.tokens - 1)
        ratios = [s / t for s, t in zip(seq_s, bat_s)]
        env = environment()
        row = {"device": env["device"], "blas": env["blas"], "blas_kind": env["blas_kind"], "git": env["git"],
               "model": a.model, "dtype": a.dtype, "batch": b, "tokens": a.tokens, "reps": a.reps,
               "prompt_tokens": [len(p) for p in prompts],
               "one_by_one_tps": round(decoded / statistics.median(seq_s), 2),
               "batched_tps": round(decoded / statistics.median(bat_s), 2),
               "batched_over_one_by_one": [round(r, 3) for r in ratios],
               "rows_equal": [x == y for x, y in zip(bat_rows, seq_rows)]}
        emit(row, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "jobs/batch_probe.py"))
