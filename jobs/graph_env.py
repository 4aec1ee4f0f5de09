"""What one decode step, one verify round and one batched data step cost under MLX's CUDA-graph
settings: a SmolLM2-135M-shaped llama with random weights (the costs depend on shapes, not
weights), driven through the harness's own Target (shape-stable attention, tree masks).

    python jobs/graph_env.py [--out costs.jsonl] [--label NAME]

MLX's CUDA backend records kernels into CUDA graphs of MLX_MAX_OPS_PER_BUFFER nodes and keeps
the instantiated graphs in a cache of MLX_CUDA_GRAPH_CACHE_SIZE entries keyed by topology, which
it empties whole when it overflows. Both are read once per process, so run this script once per
setting (jobs/graph-env.sh does) and compare the lines; a machine still compiling kernels gets
faster from one process to the next, so give each setting twice, interleaved (A B A B).

Each line also holds the host's time to build each call's lazy graph (`build_*`), one op's build
cost by kind (`op_build_us`), and with --dispatch the Target's costs under each other
stable-attention / few-row-GEMM pair. With --methods, each drafting method's rounds run through
the harness's own loop with the drafters shipped for SmolLM2, phase by phase (host time beside
each phase's time): what a cell's profile shows, without the GGUF's 16 staging calls. Off CUDA it
runs the same work (--tiny: the llama fixture's shape and drafters, a check of the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from harness import blas

blas.select()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

import engines.runtime.dispatch as dispatch_module  # noqa: E402
from engines.runtime.target import Target  # noqa: E402
from harness.errors import ConfigError  # noqa: E402
from harness.faults import guarded  # noqa: E402
from harness.models.fixtures import FIXTURES  # noqa: E402

SMOLLM2 = dict(model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
               num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152,
               rope_theta=100000.0, tie_word_embeddings=True)
TINY = {k: v for k, v in FIXTURES["llama"].items() if k not in ("bos_token_id", "eos_token_id")}  # its drafters fit
TREE_15 = [-1, 0, 1, 2, 1, 0, 5, -1, 7, 8, 7, -1, 11, -1, 13]  # 15 nodes, 4 deep: an EAGLE-3 4/4/15 shape
TREE = {"depth": 4, "top_k": 4, "total_tokens": 15}  # the EAGLE-3 tree the SmolLM2 cells run
DRAFTERS = Path("harness/data/drafters/smollm2")  # the shipped drafters, by kind
ROOT = Path(__file__).resolve().parent.parent


def emit(row: dict, out: Path | None) -> None:
    """A job's result row: one JSON line on stdout, appended to `out` when given (the jobs' --out)."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with out.open("a") as f:
            f.write(line + "\n")


def build(cfg: dict, dtype, bits: int = 0) -> llama.Model:
    """Random weights in `dtype`; with `bits`, quantized in groups of 32 as the Q4_1 / Q8_0 GGUF
    import leaves SmolLM2 (the few-row GEMM then never applies)."""
    model = llama.Model(llama.ModelArgs(**cfg))
    model.set_dtype(dtype)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def per_call_ms(fn, n: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - t0) * 1e3 / n, 3)


def target_costs(model, vocab: int, context: int, n: int, **dispatch) -> dict:
    # One sequence through the harness's Target (dispatch: its stable_attention / small_m_gemm
    # overrides): a decode step read each time, a pipelined one (per step), chain verifies of
    # 2/8/16 with a rollback of all but one, a 15-node tree verify with a compaction, and that tree
    # with its boolean mask as it was before 2026-12-06 (converted by MLX in every layer). The
    # calls are interleaved, one of each per pass, and each cost is the median over n passes, so a
    # host that drifts or stalls moves every cost alike. `build_*`: the host's time to build that
    # call's lazy graph, before anything is evaluated (median).
    t = Target(model, **dispatch)
    t.prefill(mx.random.randint(0, vocab, (context,)).tolist())
    built: dict[str, list[float]] = {}

    def timed_build(name, make):
        t0 = time.perf_counter()
        out = make()
        built.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    start = t.mark()  # every call below rewinds to the prompt's end

    def step():
        mx.eval(mx.argmax(timed_build("step", lambda: t.forward([1])).logits[-1]))
        t.rewind(start)

    def pipelined(k=8):
        ys = []
        y = mx.array([1])
        for _ in range(k):
            y = mx.argmax(t.forward(y).logits[-1:], axis=-1)
            mx.async_eval(y)
            ys.append(y)
        mx.eval(ys)
        t.rewind(start)

    def chain(T):
        def go():
            out = timed_build(f"verify_{T}", lambda: t.verify(list(range(1, T + 1))))
            mx.eval(mx.argmax(out.logits, axis=-1))
            t.commit(1)
            t.rewind(start)
        return go

    def tree(name="tree_16"):
        out = timed_build(name, lambda: t.verify_tree(list(range(16)), TREE_15))
        mx.eval(mx.argmax(out.logits, axis=-1))
        t.commit_tree([0, 1, 2])
        t.rewind(start)

    def tree_bool_mask():
        additive = dispatch_module.additive
        dispatch_module.additive = lambda mask, dtype, masks=None: mask
        try:
            tree("tree_16_bool_mask")
        finally:
            dispatch_module.additive = additive

    calls = {"step": (step, 1), "step_pipelined": (pipelined, 8), **{f"verify_{T}": (chain(T), 1) for T in (2, 8, 16)},
             "tree_16": (tree, 1), "tree_16_bool_mask": (tree_bool_mask, 1)}
    return {**interleaved_ms(calls, n),
            **{f"build_{k}": round(statistics.median(v) * 1e3, 3) for k, v in built.items()}}


def interleaved_ms(calls: dict, n: int, warm: int = 3) -> dict:
    """{name: median ms per unit} over n passes that each run every call once, in turn; calls maps
    a name to (fn, units per call)."""
    for fn, _ in calls.values():
        for _ in range(warm):
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(n):
        for name, (fn, units) in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3 / units)
    return {name: round(statistics.median(v), 3) for name, v in times.items()}


def method_config(name: str, drafter: Path, knobs: dict):
    """conf/method/<name>.yaml composed by Hydra as a cell composes it (defaults, interpolation,
    the schema's types), with the drafter and these knobs set."""
    from harness.config import register_configs
    from harness.flags import compose_first_job

    register_configs()
    overrides = [f"method={name}", f"method.drafter='{drafter}'", *(f"method.{k}={v}" for k, v in knobs.items())]
    return compose_first_job("config", overrides).method


def drafter_rounds(model, vocab: int, context: int, n: int, methods: list[str], tiny: bool) -> dict:
    """Each drafting method's rounds through the harness's own loop (harness.loop.generate, profiled):
    {method: {"phase_ms", "host_ms", "round_ms", "rounds"}}, medians over n rounds after 4 warm-up
    rounds. The drafters are the ones shipped for SmolLM2 (--tiny: the llama fixture's). On random
    target weights a drafter is rarely right, so nearly every round verifies its whole draft and
    keeps one token: the costs of a full draft, not of this target's real acceptance."""
    from engines.registry import get_engine
    from engines.runtime.sampling import Sampler
    from harness.loop import Round, generate
    from harness.models import fixtures

    out = {}
    for name in methods:
        kind = get_engine(name).drafter_kind
        drafter = fixtures.drafter_dir(kind, "llama") if tiny else ROOT / DRAFTERS / kind
        engine = get_engine(name).build(model, method_config(name, drafter, TREE if name == "eagle3" else {}))
        prompt = mx.random.randint(0, vocab, (context,)).tolist()
        events = generate(engine, prompt, n + 5, Sampler(), profile=True)
        rounds = [e for e in events if isinstance(e, Round)][4:]
        keys = list(rounds[0].phases)
        med = lambda field, k: round(statistics.median(getattr(r, field).get(k, 0.0) for r in rounds) * 1e3, 3)
        out[name] = {"phase_ms": {k: med("phases", k) for k in keys}, "host_ms": {k: med("host", k) for k in keys},
                     "round_ms": round(statistics.median(sum(r.phases.values()) for r in rounds) * 1e3, 3),
                     "rounds": len(rounds)}
    return out


def op_build_us(cfg: dict, dtype, n: int = 20000) -> dict:
    # The host's cost of building (not running) one op of each kind a decoder layer calls, microseconds.
    H, D = cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"]
    x = mx.zeros((1, H, 1, D), dtype=dtype)
    h = mx.zeros((1, 1, cfg["hidden_size"]), dtype=dtype)
    w = mx.ones((cfg["hidden_size"],), dtype=dtype)
    lin = nn.Linear(cfg["hidden_size"], cfg["hidden_size"], bias=False)
    lin.set_dtype(dtype)
    mx.eval(x, h, w, lin.parameters())
    ops = {"add": lambda: h + h,
           "linear": lambda: lin(h),
           "fast.rms_norm": lambda: mx.fast.rms_norm(h, w, 1e-5),
           "fast.rope": lambda: mx.fast.rope(x, D, traditional=False, base=cfg["rope_theta"], scale=1.0, offset=300),
           "fast.sdpa": lambda: mx.fast.scaled_dot_product_attention(x, x, x, scale=1.0)}
    out = {}
    for name, op in ops.items():
        t0 = time.perf_counter()
        for _ in range(n):
            op()
        out[name] = round((time.perf_counter() - t0) * 1e6 / n, 2)
    return out


def batch_step_ms(model, vocab: int, rows: int, context: int, n: int) -> float:
    # One decode step of `rows` sequences in mlx-lm's BatchKVCache (train/batch_decode.py's step).
    cache = [BatchKVCache([0] * rows) for _ in make_prompt_cache(model)]
    x = mx.random.randint(0, vocab, (rows, context))
    y = mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)
    mx.eval(y)

    def block(k=8):
        nonlocal y
        ys = []
        for _ in range(k):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1, :], axis=-1)
            mx.async_eval(y)
            ys.append(y)
        mx.eval(ys)
    return round(per_call_ms(block, max(1, n // 8), warm=1) / 8, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--label", default="")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and few calls: a check of the script")
    ap.add_argument("--dispatch", action="store_true",
                    help="also time the Target with each other stable_attention / small_m_gemm setting")
    ap.add_argument("--dtype", help="the model's dtype (default bfloat16; float32 with --tiny)")
    ap.add_argument("--bits", type=int, default=0, choices=(0, 4, 8),
                    help="quantize the weights (4: as the packaged Q4_1 SmolLM2 loads); 0 keeps them floating")
    ap.add_argument("--methods", nargs="*", default=[], choices=("eagle3", "dflash_a", "mtp"),
                    help="also time these methods' rounds, phase by phase, with the drafters shipped for SmolLM2 "
                         "(the draft LM shares the real target's embeddings: it refuses random weights)")
    ap.add_argument("--n", type=int, default=48, help="timed calls per measurement")
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 64, 256], help="batched data-step widths to time")
    a = ap.parse_args()
    if a.tiny and not set(a.methods) <= {"eagle3", "dflash_a"}:  # refused before any work
        ap.error("--tiny has fixture drafters for eagle3 and dflash_a only")
    if not 1 <= a.n <= 100_000 or not all(1 <= r <= 65_536 for r in a.rows):
        raise ConfigError(f"--n={a.n} and --rows={a.rows}: give 1-100000 timed calls and widths of 1-65536 rows")
    cfg = TINY if a.tiny else SMOLLM2
    context = 16 if a.tiny else 300  # keys already cached when a call is timed
    model = build(cfg, getattr(mx, a.dtype or ("float32" if a.tiny else "bfloat16")), a.bits)
    n = 4 if a.tiny else a.n
    row = {"label": a.label, "device": str(mx.default_device()), "bits": a.bits,
           "mlx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}}
    t0 = time.perf_counter()
    row.update(target_costs(model, cfg["vocab_size"], context, n))
    if a.dispatch:  # the same work under each other stable_attention / small_m_gemm pair, in this process
        cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
        routed = (True, False) if cuda and not a.bits else (cuda,)  # quantized weights: no Linear to route
        pairs = [(s, m) for s in (True, False) for m in routed if (s, m) != (cuda, cuda)]
        for stable, small in pairs:
            row[f"stable={int(stable)},small_m={int(small)}"] = target_costs(
                model, cfg["vocab_size"], context, n, stable_attention=stable, small_m_gemm=small)
    if a.methods:
        row["rounds"] = drafter_rounds(model, cfg["vocab_size"], context, n, a.methods, a.tiny)
    for rows in ((4,) if a.tiny else a.rows):
        row[f"batch_{rows}"] = batch_step_ms(model, cfg["vocab_size"], rows, 16 if a.tiny else 128, n)
    row["op_build_us"] = op_build_us(cfg, model.model.norm.weight.dtype, 200 if a.tiny else 20000)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    emit(row, a.out)


if __name__ == "__main__":
    sys.exit(guarded(main, "jobs/graph_env.py"))
