"""Answer tokens/s of train/batch_decode.py's loop for several admission sizes, on one slice of
the job's prompts: which way of keeping a batch of `width` rows full runs fastest on this device.

    python jobs/data_rate.py --model <gguf or dir> --cache <data cache with prompts.jsonl> \
        [--n 1024] [--width 256] [--admit 256 64 16 1] [--reps 2] [--out rates.json]

Each admission size decodes the same prompts (length-sorted, from the middle of the list) `reps`
times; the first rep pays the device's kernel compiles, the later ones show the steady rate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from harness.models import load_target, resolve_model
from train import batch_decode
from train.data import _encode_prompt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", required=True, type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--admit", type=int, nargs="+", default=[256, 64, 16, 1])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    model, tok = load_target(resolve_model(a.model, a.dtype), a.dtype)
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


if __name__ == "__main__":
    main()
