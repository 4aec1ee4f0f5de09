from harness import blas; blas.select()
import time, mlx.core as mx, mlx.nn as nn
from harness.models import fixtures, load, resolve
from harness.env import environment
from mlx_lm.models.cache import make_prompt_cache
ck=resolve.resolve_model("qwen2.5-coder-1.5b","float32")
print("blas", environment().get("blas"))
def rate(m, n=24):
    c=make_prompt_cache(m); y=m(mx.array([[1,2,3,4,5,6,7,8]]),cache=c); mx.eval(y)
    tok=mx.array([[100]])
    for _ in range(3): y=m(tok,cache=c); mx.eval(y)
    t=time.perf_counter()
    for _ in range(n): y=m(tok,cache=c); mx.eval(y)
    return n/(time.perf_counter()-t)
for dt in ["float32","bfloat16","float16","q8","q4"]:
    m,_=load.read_target(ck)
    if dt.startswith("q"): nn.quantize(m, group_size=64, bits=int(dt[1]))
    else: fixtures.cast_model(m, getattr(mx, dt))
    mx.eval(m.parameters())
    print(dt, f"{rate(m):.2f} tok/s", flush=True)
    del m
