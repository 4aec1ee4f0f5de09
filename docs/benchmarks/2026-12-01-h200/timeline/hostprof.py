"""Measurement script of this folder (run on the device, not part of the package): host-side cost of each phase of a llama-1b DFlash round on the device host."""
import cProfile, io, pstats, statistics as st, sys, time
from types import SimpleNamespace
import mlx.core as mx
from harness.models import scale
from harness.models.load import load_target
from harness.models.resolve import resolve_model
from harness.loop import STREAM
from engines.dflash import DFlashA
from engines.sampling import Sampler, accept_deterministic

path = resolve_model("scale:llama-1b")
model, tok = load_target(path, "native")
drafter = str(scale.dflash_dir(path))
prompt = [(i * 37) % 1000 + 5 for i in range(120)]

def rounds(eng, n=60, profile=None):
    s = Sampler(0.0, 0); eng.sampler = s
    with mx.stream(STREAM):
        tok0 = s.choose(eng.prefill(prompt)[None], 0).item()
    hist = [*prompt, tok0]
    rows = []
    for r in range(n):
        with mx.stream(STREAM):
            t0 = time.perf_counter()
            d = eng.draft(hist); t1 = time.perf_counter()
            mx.async_eval(d.tokens); t2 = time.perf_counter()
            if profile and r >= 10: profile.enable()
            logits = eng.verify(mx.array([hist[-1]], dtype=mx.int32), d); t3 = time.perf_counter()
            if profile and r >= 10: profile.disable()
            out = accept_deterministic(d.tokens, s.choose(logits, 0)); t4 = time.perf_counter()
            vals = out.tolist(); t5 = time.perf_counter()
            eng.rollback(vals[0], d); t6 = time.perf_counter()
        hist += vals[1: vals[0] + 2]
        rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t6 - t0))
    mx.eval(eng.state())
    med = [1e3 * st.median(c[10:]) for c in zip(*rows)]
    return dict(zip(["draft_build", "draft_async_eval", "verify_build", "accept_build", "eval_wait", "rollback", "round"],
                    [round(m, 3) for m in med]))

cfg = SimpleNamespace(block_size=8, drafter=drafter, verify="batched")
for label, kw in [("default", {}), ("no_small_m", {"small_m_gemm": False}), ("no_stable", {"stable_attention": False}),
                  ("neither", {"small_m_gemm": False, "stable_attention": False})]:
    eng = DFlashA.build(model, cfg, **kw)
    rounds(eng, 20)
    print(label, rounds(eng), flush=True)
eng = DFlashA.build(model, cfg)
pr = cProfile.Profile()
rounds(eng, 60, pr)
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
# a bare mlx-lm forward of 9 tokens, build time only
from mlx_lm.models.cache import make_prompt_cache
c = make_prompt_cache(model); mx.eval(model(mx.array([prompt]), cache=c)); mx.eval([x.state for x in c])
b = []
for i in range(30):
    t0 = time.perf_counter(); y = model(mx.array([[5] * 9]), cache=c); t1 = time.perf_counter(); mx.eval(y)
    for x in c: x.trim(9)
    b.append(t1 - t0)
print("bare mlx-lm forward(9) build ms", round(1e3 * st.median(b[5:]), 3))
