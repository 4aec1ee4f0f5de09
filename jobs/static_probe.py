"""Base decoding three ways on one model, interleaved in one process: mlx-lm's generate_step, the
harness's eager base (pipelined, op by op) and its static base (compiled step on static caches,
read one round late), plus compiled static verifies against eager ones. One JSON line.

    python jobs/static_probe.py [--tiny] [--dtype bfloat16] [--tokens 128] [--reps 5] [--out FILE]

Random weights of SmolLM2-135M's shape (jobs/graph_env.py's SMOLLM2; --tiny: the llama fixture's),
so it runs anywhere without a checkpoint: what it measures is the execution, not the answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from harness import blas

blas.select()

import mlx.core as mx  # noqa: E402

from engines.arms.external import MlxLm  # noqa: E402
from engines.methods.autoregressive import Autoregressive  # noqa: E402
from engines.methods.device import StaticBase  # noqa: E402
from engines.runtime.sampling import Sampler  # noqa: E402
from engines.runtime.static import StaticTarget, static_layout  # noqa: E402
from engines.runtime.target import Target  # noqa: E402
from harness.config import MethodConfig  # noqa: E402
from harness.errors import ConfigError  # noqa: E402
from harness.faults import guarded  # noqa: E402
from harness.generation import run_generation  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_env import SMOLLM2, TINY, build, emit  # noqa: E402

VERIFY_SIZES = (1, 2, 4, 8, 16)


def arms(model) -> dict:
    cfg = MethodConfig(name="base")
    fused = StaticBase.build(model, cfg)
    fused.fuse = True
    return {"mlx_lm": MlxLm.build(model, MethodConfig(name="mlx_lm")), "eager": Autoregressive.build(model, cfg),
            "static": StaticBase.build(model, cfg), "static_fused": fused}


def decode_rates(engines: dict, prompt: list[int], tokens: int, reps: int) -> dict:
    """tok/s after the first token, per arm, reps interleaved (order rotating), after a warm-up each."""
    sampler = Sampler(0.0, 0)
    outs = {}
    for eng in engines.values():
        outs[eng] = run_generation(eng, prompt, tokens, sampler).tokens  # warm-up (compiles)
    rates = {name: [] for name in engines}
    names = list(engines)
    for r in range(reps):
        for name in names[r % len(names):] + names[: r % len(names)]:
            gen = run_generation(engines[name], prompt, tokens, sampler)
            rates[name].append(gen.decode_tps)
    same = len({tuple(t) for t in outs.values()}) == 1
    return {"tps": {k: round(statistics.median(v), 2) for k, v in rates.items()},
            "ms_per_token": {k: round(1e3 / statistics.median(v), 3) for k, v in rates.items()},
            "static_over_mlx_lm": round(statistics.median(s / m for s, m in zip(rates["static"], rates["mlx_lm"])), 3),
            "fused_over_mlx_lm": round(statistics.median(s / m for s, m in zip(rates["static_fused"], rates["mlx_lm"])), 3),
            "eager_over_mlx_lm": round(statistics.median(e / m for e, m in zip(rates["eager"], rates["mlx_lm"])), 3),
            "same_tokens": same}


def verify_costs(model, prompt: list[int], n: int) -> dict:
    """ms of one verify over T tokens (and a rollback to before it), eager Target and static compiled."""
    eager, static = Target(model), StaticTarget(model, static_layout(model))
    eager.prefill(prompt)
    static.prefill(prompt, 64)
    out = {"eager": {}, "static": {}}
    for label, t in (("eager", eager), ("static", static)):
        start = t.mark()
        for size in VERIFY_SIZES:
            ids = mx.array([1] * size, dtype=mx.int32)

            def call():
                logits = t.verify(ids).logits
                mx.eval(mx.argmax(logits, axis=-1))
                t.rewind(start)

            for _ in range(3):
                call()
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            out[label][size] = round((time.perf_counter() - t0) * 1e3 / n, 3)
    out["static_traces"] = static.traces
    return out


def drafter_dir(cfg: dict, dtype, where: Path) -> Path:
    """A random 2-layer model of the target's shape saved as a draft model checkpoint."""
    small = {**cfg, "num_hidden_layers": 2}
    model = build(small, dtype)
    where.mkdir(parents=True, exist_ok=True)
    model.save_weights(str(where / "model.safetensors"))
    (where / "config.json").write_text(json.dumps(small))
    return where


def round_costs(model, prompt: list[int], tokens: int, reps: int, drafter: Path) -> dict:
    """ms per round of n-gram (K=3) and a draft model (K=3), eager and static (random weights: rounds
    accept next to nothing, so this is what a round costs, not what it gains), medians over reps."""
    from engines.methods.draft_model import DraftModel, DraftModelStatic
    from engines.methods.ngram import Ngram, NgramStatic

    sampler = Sampler(0.0, 0)
    kinds = {"ngram": (Ngram, NgramStatic, MethodConfig(name="ngram", block_size=4)),
             "draft_model": (DraftModel, DraftModelStatic,
                             MethodConfig(name="draft_model", block_size=4, drafter=str(drafter)))}
    out = {}
    for name, (eager_cls, static_cls, cfg) in kinds.items():
        engines = {"eager": eager_cls.build(model, cfg), "static": static_cls.build(model, cfg),
                   "static_fused": static_cls.build(model, cfg)}
        engines["static_fused"].fuse = True
        ms = {k: [] for k in engines}
        for eng in engines.values():
            run_generation(eng, prompt, tokens, sampler)  # warm-up
        for _ in range(reps):
            for label, eng in engines.items():
                gen = run_generation(eng, prompt, tokens, sampler)
                ms[label].append(1e3 * gen.decode_s / len(gen.rounds))
        out[name] = {k: round(statistics.median(v), 3) for k, v in ms.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if min(a.tokens, a.reps, a.context) < 2:
        raise ConfigError("--tokens, --reps and --context must be >= 2")
    model = build(TINY if a.tiny else SMOLLM2, getattr(mx, a.dtype or ("float32" if a.tiny else "bfloat16")))
    vocab = (TINY if a.tiny else SMOLLM2)["vocab_size"]
    prompt = mx.random.randint(0, vocab, (a.context,), key=mx.random.key(0)).tolist()
    row = {"device": str(mx.default_device()), "dtype": a.dtype or ("float32" if a.tiny else "bfloat16"),
           "model": "tiny" if a.tiny else "smollm2-shape", "context": a.context, "tokens": a.tokens}
    row["decode"] = decode_rates(arms(model), prompt, a.tokens, a.reps)
    row["verify_ms"] = verify_costs(model, prompt, 10 if a.tiny else 50)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        dtype = getattr(mx, row["dtype"])
        row["round_ms"] = round_costs(model, prompt, a.tokens, a.reps,
                                      drafter_dir(TINY if a.tiny else SMOLLM2, dtype, Path(tmp) / "drafter"))
    emit(row, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "jobs/static_probe.py"))
