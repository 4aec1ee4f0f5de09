"""Measurement script of this folder (run on the device, not part of the package): host cost per call of the few-row kernel (direct, mx.compile'd), vs a plain matmul."""
import time, statistics as st, mlx.core as mx, mlx.nn as nn
from engines import gemm
x = mx.random.normal((8, 2048)).astype(mx.bfloat16)
ws = [mx.random.normal((n, 2048)).astype(mx.bfloat16) * 0.02 for n in (2048, 512, 512)]
mx.eval(x, ws)
def per_call(f, n=400, reps=5):
    best = 1e9
    for _ in range(reps):
        t = time.perf_counter(); outs = [f() for _ in range(n)]; t1 = time.perf_counter()
        mx.eval(outs); t2 = time.perf_counter()
        best = min(best, (t1 - t) / n)
    return round(best * 1e6, 2), round((t2 - t1) / n * 1e6, 2)
print("matmul      build/eval us", per_call(lambda: x @ ws[0].T))
print("kernel1     build/eval us", per_call(lambda: gemm.grouped_matmul(x, ws[:1])))
print("kernel3     build/eval us", per_call(lambda: gemm.grouped_matmul(x, ws)))
c1 = mx.compile(lambda a, b: gemm.grouped_matmul(a, [b])[0])
c3 = mx.compile(lambda a, b, c, d: gemm.grouped_matmul(a, [b, c, d]))
print("compiled1   build/eval us", per_call(lambda: c1(x, ws[0])))
print("compiled3   build/eval us", per_call(lambda: c3(x, *ws)))
y0 = gemm.grouped_matmul(x, ws); y1 = c3(x, *ws)
print("compiled == direct:", all(mx.array_equal(a, b).item() for a, b in zip(y0, y1)))
lin = nn.Linear(2048, 2048, bias=False); lin.weight = ws[0]
with gemm.small_m_linears(True):
    print("routed lin  build/eval us", per_call(lambda: lin(x[None])))
print("plain lin   build/eval us", per_call(lambda: lin(x[None])))
g = mx.random.normal((8192, 2048)).astype(mx.bfloat16) * 0.02; u = g * 1.5; d = mx.random.normal((2048, 8192)).astype(mx.bfloat16) * 0.02
mx.eval(g, u, d)
def mlp(a, g, u, d):
    y0, y1 = gemm.grouped_matmul(a, [g, u])
    return gemm.grouped_matmul(nn.silu(y0) * y1, [d])[0]
cm = mx.compile(mlp)
print("mlp direct  build/eval us", per_call(lambda: mlp(x, g, u, d), n=200))
print("mlp compiled build/eval us", per_call(lambda: cm(x, g, u, d), n=200))
print("mlp compiled == direct:", mx.array_equal(cm(x, g, u, d), mlp(x, g, u, d)).item())
