"""Matmuls over a few rows on CUDA tensor cores: what a verify of 2-16 tokens multiplies.

A decode step multiplies 1 row by each weight (a gemv) and a verify of a DFlash block
multiplies 8; both read the same weight bytes, so both should cost about the same. MLX's
CUDA backend sends more than one row to a general GEMM, which costs 2-3x its gemv at these
sizes (H200, bf16, 2048->8192: 22-35 us at 8 rows against 10-15 us at 1, two runs). This
kernel streams each weight row once through m16n8k16 MMAs, the weight as the 16-row
operand and the few input rows as the 8-column one: 17 us for that shape, 15 / 26 us for
2048->2048 / 8192->2048 (GEMM: 23 / 35). A llama-1b DFlash round went from 9.46 to
8.10 ms with it (docs/benchmarks/2026-12-01-h200). Only the summation order differs from
MLX's GEMM (fp32 accumulation in both), so outputs agree to bf16 rounding; the divergence
check reports what that changes (at exact ties).

CUDA only; everywhere else, and for any shape it does not take, nn.Linear runs as it is.
"""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn

MAX_ROWS = 16
WARPS = 8  # warps per block, splitting K: K must be a multiple of 32 * WARPS

_HEADER = r"""
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b, __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
"""

_SOURCE = r"""
    // x [M, K], w [N, K] row contiguous -> y [M, N]. A block owns 16 output features; its
    // WARPS warps split K. Within a 32-wide k chunk a lane loads 8 contiguous values of each
    // of its rows: a dot product is the same sum in any k order, so A (w) and B (x) share one
    // permuted order and every load is 16 bytes.
    constexpr int NT = (M + 7) / 8;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    int n0 = blockIdx.y * 16;
    const T* w0 = w + (size_t)(n0 + g) * K + 8 * t;
    const T* w1 = w0 + (size_t)8 * K;
    float c[NT][4];
    #pragma unroll
    for (int i = 0; i < NT; ++i) { c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f; }
    #pragma unroll 4
    for (int kb = warp * 32; kb < K; kb += WARPS * 32) {
      uint4 lo = __ldg(reinterpret_cast<const uint4*>(w0 + kb));
      uint4 hi = __ldg(reinterpret_cast<const uint4*>(w1 + kb));
      uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
      #pragma unroll
      for (int i = 0; i < NT; ++i) {
        int row = g + 8 * i;
        uint4 bx = row < M ? __ldg(reinterpret_cast<const uint4*>(x + (size_t)row * K + kb + 8 * t))
                           : make_uint4(0, 0, 0, 0);
        uint32_t b0[2] = {bx.x, bx.y}, b1[2] = {bx.z, bx.w};
        mma16816(c[i], a0, b0, T());
        mma16816(c[i], a1, b1, T());
      }
    }
    // the WARPS partial tiles summed in a fixed order: deterministic
    __shared__ float red[WARPS][16][8 * NT];
    #pragma unroll
    for (int i = 0; i < NT; ++i) {
      red[warp][g][8 * i + 2 * t] = c[i][0];
      red[warp][g][8 * i + 2 * t + 1] = c[i][1];
      red[warp][g + 8][8 * i + 2 * t] = c[i][2];
      red[warp][g + 8][8 * i + 2 * t + 1] = c[i][3];
    }
    __syncthreads();
    int r = threadIdx.x & 15, m = threadIdx.x >> 4;
    if (m < M) {
      float s = 0.0f;
      #pragma unroll
      for (int v = 0; v < WARPS; ++v) s += red[v][r][m];
      y[(size_t)m * N + n0 + r] = static_cast<T>(s);
    }
"""

_KERNEL = (mx.fast.cuda_kernel("harness_small_m_gemm", ["x", "w"], ["y"], _SOURCE, header=_HEADER)
           if mx.cuda.is_available() else None)
_LAUNCH: dict = {}  # (M, K, N, dtype) -> the kernel's keyword arguments, built once per shape


def available() -> bool:
    """Whether this process can run the kernel (MLX's CUDA backend on the default device)."""
    return _KERNEL is not None and mx.default_device() == mx.gpu


def takes(rows: int, weight: mx.array, dtype) -> bool:
    """Whether x [rows, K] @ weight.T [K, N] goes to the kernel."""
    N, K = weight.shape
    return (2 <= rows <= MAX_ROWS and dtype == weight.dtype and dtype in (mx.bfloat16, mx.float16)
            and N % 16 == 0 and K % (32 * WARPS) == 0)


def small_m_matmul(x: mx.array, w: mx.array) -> mx.array:
    """x [M, K] @ w[N, K].T -> [M, N] on the kernel (callers check takes())."""
    M, K = x.shape
    N = w.shape[0]
    key = (M, K, N, x.dtype)
    if key not in _LAUNCH:
        _LAUNCH[key] = dict(template=[("T", x.dtype), ("M", M), ("K", K), ("N", N), ("WARPS", WARPS)],
                            grid=(32 * WARPS, N // 16, 1), threadgroup=(32 * WARPS, 1, 1),
                            output_shapes=[(M, N)], output_dtypes=[x.dtype])
    return _KERNEL(inputs=[x, w], **_LAUNCH[key])[0]


def _linear(original, matmul):
    def __call__(self, x):
        # x [..., K] with 2-16 rows in all -> [..., N]
        rows = x.size // x.shape[-1]
        if not takes(rows, self.weight, x.dtype):
            return original(self, x)
        y = matmul(x.reshape(rows, -1), self.weight).reshape(*x.shape[:-1], -1)
        return y + self.bias if "bias" in self else y
    __call__.small_m = True
    return __call__


@contextmanager
def small_m_linears(enabled: bool, matmul=None):
    """Within the block, every nn.Linear over 2-16 rows in bf16/fp16 runs small_m_matmul
    (or `matmul`, for tests). Quantized layers are their own class and stay as they are."""
    original = nn.Linear.__call__
    if not enabled or getattr(original, "small_m", False):
        yield
        return
    nn.Linear.__call__ = _linear(original, matmul or small_m_matmul)
    try:
        yield
    finally:
        nn.Linear.__call__ = original
