"""Where a static step's time goes on one device: one decode step (T=1) timed four ways on SmolLM2's
shape (random weights), then the attention alone with and without a mask over the buffer.

    python jobs/static_parts_probe.py [--tiny] [--context 150] [--steps 100] [--out FILE]

Step arms, each a loop of `steps` one-token forwards with an eval per step (as decoding pays):
  eager           engines.runtime.target.Target (mlx-lm's KVCache: keys up to the position, no mask array)
  static_eager    StaticTarget's uncompiled function (the buffer's capacity of keys, a mask array)
  static_compiled StaticTarget.forward (the same, compiled)
(on CUDA both static arms attend on engines/kernels/live_attention.py's kernel: `attention` names which ran)
Attention arms (30 layers' worth in one graph, SmolLM2's heads): sdpa over the live keys without a
mask, over the whole buffer with a boolean mask, and with an additive one, and (CUDA) the live-length
kernel over the whole buffer. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from harness import blas

blas.select()

import mlx.core as mx  # noqa: E402

from engines.kernels import live_attention as la  # noqa: E402
from engines.runtime.static import StaticTarget, static_layout  # noqa: E402
from engines.runtime.target import Target  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_env import SMOLLM2, TINY, build  # noqa: E402


def per_step_ms(step, steps: int) -> float:
    for _ in range(5):  # warm-up: compiles, kernel JIT
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return round((time.perf_counter() - t0) * 1e3 / steps, 3)


def step_arms(model, prompt: list[int], steps: int) -> dict:
    eager, static = Target(model), StaticTarget(model, static_layout(model))
    eager.prefill(prompt)
    static.prefill(prompt, 64)
    one = mx.array([1], dtype=mx.int32)
    e_mark, s_mark = eager.mark(), static.mark()

    def eager_step():
        mx.eval(mx.argmax(eager.forward(one).logits, axis=-1))
        eager.rewind(e_mark)

    def static_eager_step():
        logits, _ = static._run(one)
        static.set_position(static.position + 1)
        mx.eval(mx.argmax(logits, axis=-1), static.state.arrays)
        static.rewind(s_mark)

    def static_compiled_step():
        mx.eval(mx.argmax(static.forward(one).logits, axis=-1), static.state.arrays)
        static.rewind(s_mark)

    return {"capacity": static.state.capacity, "attention": static.attention, "eager": per_step_ms(eager_step, steps),
            "static_eager": per_step_ms(static_eager_step, steps),
            "static_compiled": per_step_ms(static_compiled_step, steps)}


def attention_arms(cfg: dict, live: int, capacity: int, dtype, steps: int) -> dict:
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // heads
    layers = cfg["num_hidden_layers"]
    q = mx.random.normal((1, heads, 1, d)).astype(dtype)
    k = mx.random.normal((1, kv, capacity, d)).astype(dtype)
    v = mx.random.normal((1, kv, capacity, d)).astype(dtype)
    keep = (mx.arange(capacity) < live)[None, None, None, :]
    additive = mx.where(keep, 0.0, -mx.inf).astype(dtype)
    mx.eval(q, k, v, keep, additive)
    sdpa = mx.fast.scaled_dot_product_attention

    def run(fn):
        def step():
            x = q
            for _ in range(layers):  # one chain, as the layers are
                x = fn(x)
            mx.eval(x)
        return per_step_ms(step, steps)

    return {"live": live, "capacity": capacity,
            "no_mask_live_keys": run(lambda x: sdpa(x, k[:, :, :live], v[:, :, :live], scale=d ** -0.5)),
            "bool_mask_capacity": run(lambda x: sdpa(x, k, v, scale=d ** -0.5, mask=keep)),
            "additive_mask_capacity": run(lambda x: sdpa(x, k, v, scale=d ** -0.5, mask=additive)),
            "additive_mask_live_keys": run(lambda x: sdpa(x, k[:, :, :live], v[:, :, :live], scale=d ** -0.5,
                                                          mask=additive[..., :live])),
            "by_hand_capacity": run(lambda x: by_hand(x, k, v, additive, d ** -0.5)),
            **({"live_kernel_capacity": run(lambda x: la.attend(x, k, v, mx.array(live), d ** -0.5, None))}
               if la.kernel_available() else {})}


def by_hand(q, k, v, additive, scale):
    # q [1, H, 1, D], k/v [1, KV, C, D]: the GQA groups as a reshape, softmax over the masked scores
    b, h, t, d = q.shape
    kv = k.shape[1]
    qg = (q * scale).reshape(b, kv, h // kv * t, d)
    p = mx.softmax(qg @ k.swapaxes(-1, -2) + additive[0], axis=-1, precise=True)
    return (p @ v).reshape(b, h, t, d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    cfg = TINY if a.tiny else SMOLLM2
    dtype_name = a.dtype or ("float32" if a.tiny else "bfloat16")
    dtype = getattr(mx, dtype_name)
    model = build(cfg, dtype)
    prompt = mx.random.randint(0, cfg["vocab_size"], (a.context,), key=mx.random.key(0)).tolist()
    row = {"device": str(mx.default_device()), "dtype": dtype_name, "model": "tiny" if a.tiny else "smollm2-shape",
           "context": a.context, "steps": a.steps}
    row["step_ms"] = step_arms(model, prompt, a.steps)
    row["attention_ms"] = attention_arms(cfg, a.context + 1, row["step_ms"]["capacity"], dtype, a.steps)
    line = json.dumps(row)
    print(line, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
