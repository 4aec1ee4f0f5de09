"""Answer tokens/s of train/batch_decode.py's loop for several admission sizes, on one slice of
the job's prompts: which way of keeping a batch of `width` rows full runs fastest on this device.

    python jobs/data_rate.py --model <gguf or dir> --cache <data cache with prompts.jsonl> \
        [--n 1024] [--width 256] [--admit 256 64 16 1] [--reps 2] [--out rates.json]

Each admission size decodes the same prompts (length-sorted, from the middle of the list) `reps`
times; the first rep pays the device's kernel compiles, the later ones show the steady rate.
`--grid` instead times one decode step of the batch at several widths and context lengths
(what a step's cost grows with).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

from harness.errors import ConfigError
from harness.faults import guarded
from harness.models.load import load_target
from harness.models.resolve import resolve_model
from train import batch_decode
from train.data import _encode_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", type=Path, help="a data cache holding prompts.jsonl (not needed with --grid)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--admit", type=int, nargs="+", default=[256, 64, 16, 1])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--grid", action="store_true")
    a = ap.parse_args()
    if min(a.n, a.width, a.max_new, a.reps, *a.admit) < 1:
        raise ConfigError(f"--n, --width, --max-new, --reps and --admit must all be >= 1 (got {a.n}, {a.width}, "
                          f"{a.max_new}, {a.reps}, {a.admit})")
    model, tok = load_target(resolve_model(a.model, a.dtype), a.dtype)
    if a.grid:
        step_grid(model, a.out)
        return 0
    if a.cache is None:
        ap.error("--cache <data cache with prompts.jsonl> is needed to time the admission sizes")
    texts = [json.loads(line)["prompt"] for line in (a.cache / "prompts.jsonl").read_text().splitlines()]
    ids = sorted((_encode_prompt(tok, t) for t in texts), key=len)
    mid = max(0, len(ids) // 2 - a.n // 2)
    ids = ids[mid: mid + a.n]
    greedy = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    out = []
    for admit in a.admit:
        for rep in range(a.reps):
            t0 = time.perf_counter()
            answers = batch_decode.decode(model, ids, a.max_new, set(tok.eos_token_ids), greedy, width=a.width,
                                          admit=admit)
            secs = time.perf_counter() - t0
            n = sum(map(len, answers))
            out.append({"admit": admit, "rep": rep, "answer_tokens": n, "seconds": round(secs, 3),
                        "tokens_per_s": round(n / secs, 1)})
            print(json.dumps(out[-1]), flush=True)
    if a.out:
        a.out.write_text(json.dumps({"device": str(mx.default_device()), "width": a.width, "n": len(ids),
                                     "runs": out}, indent=1))


def step_grid(model, out: Path | None, widths=(1, 16, 64, 256), contexts=(64, 256, 640), steps=32) -> None:
    # ms per decode step of `width` rows at `context` cached tokens (each measured after a warm pass).
    rows = []
    for width in widths:
        for context in contexts:
            ms = [_time_steps(model, width, context, steps) for _ in range(2)][-1]
            rows.append({"width": width, "context": context, "ms_per_step": round(ms, 3),
                         "row_tokens_per_s": round(width / ms * 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)
    if out:
        out.write_text(json.dumps({"device": str(mx.default_device()), "grid": rows}, indent=1))


def _time_steps(model, width: int, context: int, steps: int) -> float:
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    cache = [BatchKVCache([0] * width) for _ in make_prompt_cache(model)]
    x = mx.random.randint(0, 1000, (width, context)).astype(mx.int32)
    y = mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y, [c.state[:2] for c in cache])
    t0 = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
        mx.async_eval(y)
    mx.eval(y)
    return (time.perf_counter() - t0) / steps * 1e3


if __name__ == "__main__":
    sys.exit(guarded(main, "jobs/data_rate.py"))
