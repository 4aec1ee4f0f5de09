"""mlx-lm behind the harness's subprocess protocol: a complete adapter in a few dozen lines.

    python -m harness method=subprocess \
        method.command="python examples/mlx_lm_adapter.py --model <mlx-lm dir> --dtype float32"

Wire your own engine the same way: write a ready line (saying, if you can, which library
serves your matrix products: the record then shows whether you ran on the harness's BLAS),
then for each generate request one line per token (or per round, with drafted/accepted),
then a done line; exit at EOF on stdin. Logs go to stderr, never stdout.
"""

import argparse
import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from harness.env import blas_library


def send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def generate(model, req: dict) -> None:
    """One request's token lines and its done line."""
    mx.random.seed(req["seed"])
    temp = req["temperature"]
    sample = (lambda lp: mx.argmax(lp, axis=-1)) if temp == 0 else (lambda lp: mx.random.categorical(lp / temp))
    cache = make_prompt_cache(model)
    steps = generate_step(mx.array(req["prompt_ids"]), model, max_tokens=req["max_new_tokens"], sampler=sample,
                          prompt_cache=cache)
    for token, _ in steps:
        send({"id": req["id"], "tokens": [int(token)]})
        if int(token) in req["stop_ids"]:
            break
    # generate_step queues a step past the last token: finish it before `done`, so that it does
    # not run on the CPU while the harness times its next arm (the harness waits for `done`).
    mx.eval([c.state for c in cache])
    send({"id": req["id"], "done": True})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default=None, help="cast the weights (e.g. float32), as the harness's arch.dtype does")
    args = ap.parse_args()
    model, _ = load(args.model)
    if args.dtype:
        model.set_dtype(getattr(mx, args.dtype))
    from importlib.metadata import version

    send({"type": "ready", "implementation": "mlx_lm.generate_step (examples/mlx_lm_adapter.py)",
          "version": version("mlx-lm"), "blas": blas_library()})  # what serves cblas_sgemm in this process
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("type") == "generate":
            generate(model, req)


if __name__ == "__main__":
    main()
