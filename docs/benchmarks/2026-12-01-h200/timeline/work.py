"""Measurement script of this folder (run on the device, not part of the package): windows of llama-1b generation for the CUPTI shim's timeline."""
import ctypes, json, os, sys, time
from types import SimpleNamespace
import mlx.core as mx
from harness.models import scale
from harness.models.load import load_target
from harness.models.resolve import resolve_model
from engines.target import Target
from engines.dflash import DFlashA
from engines.external import DFlashZlab, MlxLm
from engines.autoregressive import Autoregressive
from engines.sampling import Sampler
from harness.generation import run_generation

shim = ctypes.CDLL(os.environ["SHIM"]) if os.environ.get("SHIM") else None
if shim:
    shim.cupti_now.restype = ctypes.c_ulonglong
now = (lambda: shim.cupti_now()) if shim else (lambda: 0)
preset = sys.argv[1] if len(sys.argv) > 1 else "llama-1b"
path = resolve_model(f"scale:{preset}")
model, tok = load_target(path, "native")
drafter = str(scale.dflash_dir(path))
prompt = [(i * 37) % 1000 + 5 for i in range(120)]
cfg = SimpleNamespace(block_size=8, drafter=drafter, verify="batched")
arms = {"dflash_a": DFlashA.build(model, cfg), "zlab": DFlashZlab(Target(model), cfg),
        "base": Autoregressive(Target(model), None), "mlx_lm": MlxLm(Target(model), None)}
arms["zlab"].tokenizer = tok; arms["mlx_lm"].tokenizer = tok
s = Sampler(0.0, 0)
windows = []
for rep in range(2):
    for name, eng in arms.items():
        run_generation(eng, prompt, 96, s)  # warm: the same shapes as the window
        mx.synchronize()
        t0 = now(); w0 = time.perf_counter()
        g = run_generation(eng, prompt, 96, s)
        mx.synchronize()
        t1 = now(); w1 = time.perf_counter()
        windows.append({"arm": name, "rep": rep, "start": t0, "end": t1, "wall_s": w1 - w0,
                        "rounds": len(g.rounds), "tokens": len(g.tokens), "decode_s": g.decode_s,
                        "prefill_s": g.prefill_s})
        print(name, rep, len(g.rounds), f"{1e3 * g.decode_s / len(g.rounds):.3f} ms/round", flush=True)
if shim:
    shim.cupti_flush()
json.dump(windows, open(os.path.join(os.environ.get("OUT", "/tmp"), f"windows-{preset}.json"), "w"), indent=1)
