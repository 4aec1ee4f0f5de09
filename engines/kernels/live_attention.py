"""One-token attention over a static KV buffer, its live length read on the device (CUDA).

A static cache (engines/runtime/static.py) hands attention its whole buffer and a mask built from the
position. MLX's CUDA scaled_dot_product_attention takes its unfused path for any mask array,
whatever the number of keys, so a static one-token step pays more than mlx-lm's, which hands
the fused kernel exactly the live keys and no mask (the H100 measurement is in
docs/benchmarks/2026-12-07-h100-static). Here a CUDA kernel attends each query head's one row
over the keys [lo, len) of its buffer, where len is the cache's position (a device value, so
no host read and one shape per buffer) and lo the start of a sliding window: no mask at all.

`live_attention(modules)` swaps it in for one-token calls on a StaticKVCache (the swap is
engines/runtime/patches.py `attention_function`); every other call (several tokens, a tree, attention
sinks, a plain cache) and every other device runs the original, masked. `reference` is the
same computation in MLX ops: what the kernel must equal, and what the CPU tests check.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import mlx.core as mx

from engines.runtime.patches import attention_function

WARPS = 4  # warps per query head: each takes every WARPS-th key, their partial softmaxes merged at the end

_SOURCE = r"""
    // grid (32 * W, Hq, 1) threads in blocks of (32 * W, 1, 1): one block per query head; warp w takes
    // keys lo + w, lo + w + W, ...; lane l holds elements l, l + 32, ... of the query and of its output.
    constexpr int W = WARPS;
    constexpr int per = D / 32;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32, h = blockIdx.y;
    const int Hq = q_shape[1], Hkv = k_shape[1], C = k_shape[2];
    const int hk = h / (Hq / Hkv);
    const int len = min(max(length[0], 0), C);
    const int lo = WINDOW > 0 ? max(0, len - WINDOW) : 0;
    const QT* q_ = q + (size_t)h * D;
    const KT* k_ = k + (size_t)hk * C * D;
    const KT* v_ = v + (size_t)hk * C * D;
    const float sc = scale[0];
    float qr[per], acc[per];
    for (int i = 0; i < per; ++i) { qr[i] = static_cast<float>(q_[i * 32 + lane]) * sc; acc[i] = 0.0f; }
    float m = -INFINITY, l = 0.0f;
    for (int j = lo + w; j < len; j += W) {
      float s = 0.0f;
      for (int i = 0; i < per; ++i) s += qr[i] * static_cast<float>(k_[(size_t)j * D + i * 32 + lane]);
      for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffff, s, o);
      const float mn = fmaxf(m, s);
      const float a = expf(m - mn), b = expf(s - mn);  // the first key: m = -inf, a = 0
      l = l * a + b;
      for (int i = 0; i < per; ++i) acc[i] = acc[i] * a + b * static_cast<float>(v_[(size_t)j * D + i * 32 + lane]);
      m = mn;
    }
    __shared__ float sm_m[W], sm_l[W], sm_acc[W * D];
    if (lane == 0) { sm_m[w] = m; sm_l[w] = l; }
    for (int i = 0; i < per; ++i) sm_acc[w * D + i * 32 + lane] = acc[i];
    __syncthreads();
    if (w == 0) {
      float M = -INFINITY;
      for (int u = 0; u < W; ++u) M = fmaxf(M, sm_m[u]);
      float L = 0.0f, o[per];
      for (int i = 0; i < per; ++i) o[i] = 0.0f;
      for (int u = 0; u < W; ++u) {
        if (sm_m[u] == -INFINITY) continue;  // a warp that saw no key
        const float f = expf(sm_m[u] - M);
        L += sm_l[u] * f;
        for (int i = 0; i < per; ++i) o[i] += sm_acc[u * D + i * 32 + lane] * f;
      }
      for (int i = 0; i < per; ++i) y[(size_t)h * D + i * 32 + lane] = static_cast<QT>(o[i] / L);
    }
"""


def _kernel():
    if not mx.cuda.is_available():
        return None
    return mx.fast.cuda_kernel("harness_live_attention", ["q", "k", "v", "length", "scale"], ["y"], _SOURCE)


_KERNEL = _kernel()


def applies(queries: mx.array, keys: mx.array) -> bool:
    """Whether the kernel runs these shapes here: CUDA, one query row, one batch row, a head size
    of 32-256 in steps of 32, query heads a multiple of the KV heads."""
    B, Hq, T, D = queries.shape
    return kernel_available() and B == 1 and T == 1 and D % 32 == 0 and D <= 256 and Hq % keys.shape[1] == 0


def kernel_available() -> bool:
    """Whether one-token static attention runs on the kernel in this process (else masked sdpa)."""
    return _KERNEL is not None and mx.default_device() == mx.gpu


def attend(queries: mx.array, keys: mx.array, values: mx.array, length: mx.array, scale: float,
           window: int | None) -> mx.array:
    """queries [1, Hq, 1, D] over keys/values [1, Hkv, C, D] at slots [max(0, L - window), L), L = length
    clamped to [0, C] -> [1, Hq, 1, D] (the kernel; call only where `applies`)."""
    D = queries.shape[-1]
    return _KERNEL(inputs=[queries, keys, values, length.astype(mx.int32).reshape(1), mx.array([scale], mx.float32)],
                   template=[("QT", queries.dtype), ("KT", keys.dtype), ("D", D), ("WARPS", WARPS),
                             ("WINDOW", window or 0)],
                   grid=(32 * WARPS, queries.shape[1], 1), threadgroup=(32 * WARPS, 1, 1),
                   output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]


def reference(queries: mx.array, keys: mx.array, values: mx.array, length: mx.array, scale: float,
              window: int | None) -> mx.array:
    """What `attend` computes, in MLX ops: the masked attention of the static cache at T = 1."""
    slots = mx.arange(keys.shape[2])
    seen = slots < length
    if window:
        seen = seen & (slots >= length - window)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=seen[None])


def _live(original, static_cache: type):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        # one query row on a static buffer whose position already counts it: keys [lo, pos) are live
        if sinks is None and isinstance(cache, static_cache) and applies(queries, keys):
            return attend(queries, keys, values, cache.offset, scale, cache.window)  # (the kernel clamps to C)
        return original(queries, keys, values, cache, scale, mask, sinks)
    return scaled_dot_product_attention


def live_attention(modules: list, static_cache: type):
    """Within the block, one-token attention on caches of type `static_cache` (engines/runtime/static.py's
    StaticKVCache: `offset` its position, `capacity`, `window`) in these mlx-lm `modules` runs on the
    kernel (module docstring). A no-op where the kernel does not run."""
    if not kernel_available() or not modules:
        return nullcontext()
    return _installed(modules, static_cache)


@contextmanager
def _installed(modules: list, static_cache: type):
    with attention_function(modules, lambda f: _live(f, static_cache)):
        yield
