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
check reports what that changes (at exact ties). Linears that read one input in turn run as
one launch (`_Runs`): a llama verify goes from 7 to 4 matmul launches per layer.

At 1B sizes a round is host-bound (the GPU was busy 16-19% of a llama-1b DFlash round in a
CUPTI timeline), so host time per call is part of the design: each launch shape is an
mx.compile'd call (`_launch`), inputs keep their leading dims, and the routed linear reads
its module's dicts directly. Before that, building a routed llama-1b verify graph took 2.7 ms
of Python against 1.4 ms unrouted (docs/benchmarks/2026-12-01-h200/timeline).

CUDA only; everywhere else, and for any shape it does not take (K not a multiple of 32, N not of
16), nn.Linear runs as it is. Warps per block are the most of 8, 6, 4, 3, 2, 1 that tile K in
32-wide chunks (`warps_for`): 8 for the 1B widths, 6 for SmolLM2-135M's 576.
"""

from __future__ import annotations

from contextlib import contextmanager
from math import prod

import mlx.core as mx
import mlx.nn as nn

from engines.runtime.patches import linear_call

MAX_ROWS = 16
WARP_CHOICES = (8, 6, 4, 3, 2, 1)  # warps per block split K: the most that divide K / 32 evenly

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

_BODY = r"""
    // x [M, K], w [N, K] row contiguous -> y [M, N]. A block owns 16 output features; its
    // WARPS warps split K. Within a 32-wide k chunk a lane loads 8 contiguous values of each
    // of its rows: a dot product is the same sum in any k order, so A (w) and B (x) share one
    // permuted order and every load is 16 bytes. M (<= 8 * NT) is read at run time, so one
    // compiled kernel serves every row count of its 8-row bucket.
    const int M = rows[0];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    const T* wa = w + (size_t)(n0 + g) * K + 8 * t;  // this lane's rows g and g + 8
    const T* wb = wa + (size_t)8 * K;
    float c[NT][4];
    #pragma unroll
    for (int i = 0; i < NT; ++i) { c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.0f; }
    #pragma unroll 4
    for (int kb = warp * 32; kb < K; kb += WARPS * 32) {
      uint4 lo = __ldg(reinterpret_cast<const uint4*>(wa + kb));
      uint4 hi = __ldg(reinterpret_cast<const uint4*>(wb + kb));
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
    // 2 * WARPS rows per pass: one pass at 8 warps (M <= 16), more with fewer warps
    int r = threadIdx.x & 15;
    for (int m = threadIdx.x >> 4; m < M; m += 2 * WARPS) {
      float s = 0.0f;
      #pragma unroll
      for (int v = 0; v < WARPS; ++v) s += red[v][r][m];
      y[(size_t)m * N + n0 + r] = static_cast<T>(s);
    }
"""


def _prelude(n: int) -> str:
    # Block y-index -> which of the n weights (w0..w{n-1}, template widths N0..) it multiplies
    # and its 16 features there: one launch for n linears that read the same x. Every block
    # runs the same code whichever weight it reads, so each output is bit-identical to the
    # one a launch of that weight alone would give.
    lines, end = [], "0"
    for j in range(n):
        start, end = end, f"{end} + N{j} / 16"
        lines.append(f"{'if' if j == 0 else 'else if'} (tile < {end}) "
                     f"{{ w = w{j}; y = y{j}; N = N{j}; n0 = (tile - ({start})) * 16; }}")
    return ("    int tile = blockIdx.y, N = 0, n0 = 0;\n    const T* w = nullptr;\n    T* y = nullptr;\n    "
            + "\n    ".join(lines) + "\n")


def _kernel(n: int):
    names = [f"w{j}" for j in range(n)]
    return mx.fast.cuda_kernel(f"harness_small_m_gemm{n}", ["x", "rows", *names], [f"y{j}" for j in range(n)],
                               _prelude(n) + _BODY, header=_HEADER)


_KERNELS: dict = {}  # number of weights -> the kernel object (CUDA only)
_CALLS: dict = {}  # (x's shape, widths, dtype) -> its launch, traced once by mx.compile
_ROWS: dict = {}  # row count -> int32 [1] holding it (the kernel's run-time M)


def available() -> bool:
    """Whether this process can run the kernel (MLX's CUDA backend on the default device)."""
    return mx.cuda.is_available() and mx.default_device() == mx.gpu


def warps_for(K: int) -> int:
    """Warps splitting a K-long dot product: the most (of WARP_CHOICES) whose 32-wide chunks
    tile K exactly, so no lane reads past a row (K = 576, SmolLM2's width, takes 6)."""
    return next(w for w in WARP_CHOICES if K % (32 * w) == 0)


def takes(rows: int, weight: mx.array, dtype) -> bool:
    """Whether x [rows, K] @ weight.T [K, N] goes to the kernel."""
    N, K = weight.shape
    return (2 <= rows <= MAX_ROWS and dtype == weight.dtype and dtype in (mx.bfloat16, mx.float16)
            and N % 16 == 0 and K % 32 == 0)


def row_tiles(rows: int) -> int:
    """8-row MMA tiles a call of `rows` rows needs: the kernel's compile-time bucket. NVRTC
    compiles once per (bucket, K, widths, dtype), not per row count: with M a template
    argument a SmolLM2 cell compiled 15 row counts x 5 shapes (over 100 s on the H200)."""
    return (rows + 7) // 8


def template(shape: tuple, widths: tuple, dtype) -> list:
    """The kernel's template arguments for x of `shape` times weights of `widths` rows: what
    NVRTC compiles once for (no row count in it, only its 8-row bucket)."""
    return [("T", dtype), ("NT", row_tiles(prod(shape[:-1]))), ("K", shape[-1]), ("WARPS", warps_for(shape[-1])),
            *((f"N{j}", w) for j, w in enumerate(widths))]


def _launch(shape: tuple, widths: tuple, dtype):
    # A call of a raw kernel object rebuilds its source and template hash every time; the
    # compiled function replays the primitive it traced once. Host time per call on the H200:
    # 4.5 -> 1.4 us (one weight), 5.9 -> 3.4 us (three).
    n, K, warps = len(widths), shape[-1], warps_for(shape[-1])
    if n not in _KERNELS:
        _KERNELS[n] = _kernel(n)
    kernel = _KERNELS[n]
    launch = dict(template=template(shape, widths, dtype),
                  grid=(32 * warps, sum(widths) // 16, 1), threadgroup=(32 * warps, 1, 1),
                  output_shapes=[(*shape[:-1], w) for w in widths], output_dtypes=[dtype] * n)
    return mx.compile(lambda x, rows, *ws: kernel(inputs=[x, rows, *ws], **launch))


def grouped_matmul(x: mx.array, ws: list) -> list:
    """x [..., K] (2-16 rows in all) @ w.T for each w [N_j, K] in one launch -> [[..., N_j]]
    (callers check takes())."""
    key = (x.shape, tuple(w.shape[0] for w in ws), x.dtype)
    call = _CALLS.get(key)
    if call is None:
        call = _CALLS[key] = _launch(*key)
        rows = x.size // x.shape[-1]
        _ROWS.setdefault(rows, mx.array([rows], mx.int32))
    return call(x, _ROWS[x.size // x.shape[-1]], *ws)


def small_m_matmul(x: mx.array, w: mx.array) -> mx.array:
    """x [..., K] @ w[N, K].T -> [..., N] on the kernel (callers check takes())."""
    return grouped_matmul(x, [w])[0]


class _Runs:
    """Linears that read one input one after another (q/k/v, gate/up, a DeltaNet's in_proj_*):
    learned from the calls, then launched as one. The first routed forward runs each linear
    alone and records which consecutive calls shared their input array; from then on the
    first of such a run launches the whole run (grouped_matmul) and leaves each other
    member's output beside it, handed over only if that member is called with the very same
    array. A call pattern that changes costs a wasted output, never a wrong one."""

    def __init__(self):
        self.run, self.x = [], None  # the current run of routed calls and the input they share
        self.stashed = []  # modules holding an output for a later call (cleared on exit)

    def see(self, module, x) -> None:
        if x is self.x and all(m is not module for m in self.run):
            self.run.append(module)
            return
        self.close()
        self.run, self.x = [module], x

    def close(self) -> None:
        if len(self.run) > 1 and "_sm_group" not in vars(self.run[0]):
            vars(self.run[0])["_sm_group"] = tuple(self.run)
        self.run, self.x = [], None

    def stash(self, module, x, y) -> None:
        vars(module)["_sm_stash"] = (x, y)
        self.stashed.append(module)

    def clear(self) -> None:
        self.close()
        for m in self.stashed:
            vars(m)["_sm_stash"] = None
        self.stashed = []


def _linear(original, matmul, grouped, runs: _Runs):
    def __call__(self, x):
        # x [..., K] with 2-16 rows in all -> [..., N]. Written for host time: this runs for
        # every linear of every routed forward (112 per llama-1b verify).
        own = vars(self)
        stash = own.get("_sm_stash")
        if stash is not None and stash[0] is x:  # a run's launcher computed this already
            own["_sm_stash"] = None
            y = stash[1]
        else:
            w = self["weight"]
            if not takes(x.size // x.shape[-1], w, x.dtype):
                return original(self, x)
            group = own.get("_sm_group")
            if group is None:
                y = matmul(x, w)
            else:
                y, *rest = grouped(x, [m["weight"] for m in group])
                for m, out in zip(group[1:], rest):
                    runs.stash(m, x, out)
            runs.see(self, x)
        return y + self["bias"] if "bias" in self else y
    __call__.small_m = True
    return __call__


@contextmanager
def small_m_linears(enabled: bool, matmul=None, grouped=None):
    """Within the block, every nn.Linear over 2-16 rows in bf16/fp16 runs small_m_matmul, and
    linears that read the same input run as one grouped_matmul launch (`_Runs`); `matmul` and
    `grouped` replace the two for tests. Quantized layers are their own class and stay as they are.
    The swap of nn.Linear.__call__ itself is engines/runtime/patches.py `linear_call`."""
    if not enabled or getattr(nn.Linear.__call__, "small_m", False):  # off, or installed already
        yield
        return
    matmul, grouped, runs = matmul or small_m_matmul, grouped or grouped_matmul, _Runs()
    try:
        with linear_call(lambda original: _linear(original, matmul, grouped, runs)):
            yield
    finally:
        runs.clear()
