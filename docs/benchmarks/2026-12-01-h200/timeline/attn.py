"""Measurement script of this folder (run on the device, not part of the package): device cost of one layer's 8-query attention, per variant, llama-1b shapes (bf16)."""
import time, mlx.core as mx
B, H, Hkv, D, T, S, L = 1, 32, 8, 64, 8, 512, 300
dt = mx.bfloat16
mx.random.seed(0)
qs = [mx.random.normal((B, H, T, D)).astype(dt) for _ in range(64)]
q1 = [mx.random.normal((B, H, 1, D)).astype(dt) for _ in range(64)]
kb, vb = mx.random.normal((B, Hkv, S, D)).astype(dt), mx.random.normal((B, Hkv, S, D)).astype(dt)
k, v = kb[:, :, :L], vb[:, :, :L]
qpos = mx.arange(L - T, L)
mask = mx.where(mx.arange(S)[None] <= qpos[:, None], mx.array(0, dt), mx.array(-mx.inf, dt))
mx.eval(qs, q1, kb, vb, k, v, mask)
sc = D ** -0.5

def mm_attn(q, k, v, m):
    # GQA by reshape: [1, Hkv, rep*T, D] against [1, Hkv, S, D]
    rep = H // Hkv
    qq = (q * sc).reshape(B, Hkv, rep * T, D)
    s = qq @ k.swapaxes(-1, -2)
    s = s.reshape(B, Hkv, rep, T, -1) + m
    p = mx.softmax(s.astype(mx.float32), axis=-1).astype(dt).reshape(B, Hkv, rep * T, -1)
    return (p @ v).reshape(B, H, T, D)

variants = {
    "cudnn_bias_buffer": lambda q: mx.fast.scaled_dot_product_attention(q, kb, vb, scale=sc, mask=mask),
    "cudnn_causal_exact": lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=sc, mask="causal"),
    "matmul_buffer": lambda q: mm_attn(q, kb, vb, mask),
    "matmul_exact": lambda q: mm_attn(q, k, v, mask[:, :L]),
}
def bench(f, inputs, n=3):
    best = 1e9
    for _ in range(n):
        mx.eval(f(inputs[0]))
        mx.synchronize(); t = time.perf_counter()
        mx.eval([f(x) for x in inputs])
        mx.synchronize(); best = min(best, (time.perf_counter() - t) / len(inputs))
    return best * 1e6
for name, f in variants.items():
    print(f"{name:22s} {bench(f, qs):7.1f} us")
print(f"{'decode_vector':22s} {bench(lambda q: mx.fast.scaled_dot_product_attention(q, k, v, scale=sc), q1):7.1f} us")
ref = mx.fast.scaled_dot_product_attention(qs[0], k, v, scale=sc, mask="causal").astype(mx.float32)
for name, f in variants.items():
    print(name, "max|diff| vs causal exact", mx.abs(f(qs[0]).astype(mx.float32) - ref).max().item())
