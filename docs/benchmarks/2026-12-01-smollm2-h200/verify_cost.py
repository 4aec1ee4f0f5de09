"""Where a verify's cost goes on SmolLM2-135M (H200): forward of T tokens vs one, per dispatch setting.

For each form (4-bit, bf16) and setting, from the same ~300-token cache: median ms of a
forward over T in {1, 2, 4, 8} tokens (graph built and evaluated), and the host time to
build the graph alone (no eval), so host-bound and device-bound costs separate.
Run on the device: python docs/benchmarks/2026-12-01-smollm2-h200/verify_cost.py OUT.json
"""

import json
import statistics
import sys
import time

import mlx.core as mx

from engines.target import Target
from harness.models.load import load_target
from harness.models.resolve import resolve_model
from harness.prompts import encode_turn, load_suite

SIZES = (1, 2, 4, 8)


def timed(target, start, t, n=15):
    tot, build = [], []
    for i in range(n + 1):
        target.rewind(start)
        mx.eval([c.state for c in target.cache])
        t0 = time.perf_counter()
        out = target.verify([1] * t).logits
        t1 = time.perf_counter()
        mx.eval(out, [c.state for c in target.cache])
        t2 = time.perf_counter()
        if i:
            tot.append(t2 - t0)
            build.append(t1 - t0)
    return 1e3 * statistics.median(tot), 1e3 * statistics.median(build)


def raw(model, ids, t, n=15):
    # mlx-lm's model with its own cache, nothing of the harness in between.
    from mlx_lm.models.cache import make_prompt_cache

    tot = []
    for i in range(n + 1):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(ids)[None], cache=cache), [c.state for c in cache])
        t0 = time.perf_counter()
        mx.eval(model(mx.array([1] * t)[None], cache=cache))
        if i:
            tot.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(tot)


def main(out_path):
    prompts = load_suite("mtbench", categories=["writing"], max_prompts=1)
    results = {}
    for form, kw in (("4bit", {"gguf_dequantize": False}), ("bf16", {})):
        model, tok = load_target(resolve_model("smollm2", "bfloat16", **kw), "bfloat16")
        ids = encode_turn(tok, prompts[0], 0, [], True) * 2  # ~300 tokens
        row = {"context": len(ids)}
        for name, opts in (("default", {}), ("no_stable", {"stable_attention": False}),
                           ("no_small_m", {"small_m_gemm": False}),
                           ("plain", {"stable_attention": False, "small_m_gemm": False})):
            target = Target(model, **opts)
            target.prefill(ids)
            mx.eval([c.state for c in target.cache])
            start = target.mark()
            row[name] = {t: timed(target, start, t) for t in SIZES}
        row["mlx_lm"] = {t: raw(model, ids, t) for t in SIZES}
        results[form] = row
        print(form, json.dumps(row), flush=True)
    with open(out_path, "w") as f:
        json.dump({"env": {"mlx": mx.__version__, "device": str(mx.default_device())}, "results": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
