"""The Gated DeltaNet recurrence per backend, and the hook that lets rollback see inside it.

mlx-lm's Qwen3.5 / Qwen3-Next layers call `gated_delta_update` by the name their module
imported from mlx_lm.models.gated_delta. mlx-lm fuses the recurrence into one Metal
kernel; on CUDA and the CPU it runs a per-step ops loop (about ten kernels per step and
layer: on the H200, 8 steps of a 1B model's layer cost 0.92 ms that way and 0.044 ms
fused). Here a fused CUDA kernel (`mx.fast.cuda_kernel`) takes its place on CUDA, and can
also write the state after every step, which is what exact rollback needs.

`RecurrenceHook` swaps the module-level name for the duration of one target forward (the
swap itself is engines/runtime/patches.py `gated_delta_update`, and `conv1d` for the taps):
- "plain": the recurrence only, fused where this backend has a kernel;
- "capture": also keep the state after every step (rollback picks one: no recompute);
- "recompute": keep the recurrence's inputs, so a rollback can re-run it over the
  accepted prefix only.
Every other path (CPU, Metal, masks, odd head sizes) runs mlx-lm's own code, which the
CPU tests cover; `PATH` names what runs here, for the record.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gated_delta as gd

from engines.runtime.patches import conv1d, gated_delta_update

_SOURCE = r"""
    // grid (32, Dv, B*Hv) threads in blocks of (32, 4, 1): one warp per value row,
    // each lane holding Dk/32 state elements of that row in registers.
    int lane = threadIdx.x;
    int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
    int n = blockIdx.z;
    int b_idx = n / Hv;
    int hv_idx = n % Hv;
    int hk_idx = hv_idx / (Hv / Hk);
    const int T = k_shape[1];  // read at run time: one compile serves every length
    constexpr int n_per_t = Dk / 32;
    const InT* q_ = q + (size_t)b_idx * T * Hk * Dk + hk_idx * Dk;
    const InT* k_ = k + (size_t)b_idx * T * Hk * Dk + hk_idx * Dk;
    const InT* v_ = v + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    InT* y_ = y + (size_t)b_idx * T * Hv * Dv + hv_idx * Dv;
    const GT* g_ = g + (size_t)b_idx * T * Hv;
    const BT* beta_ = beta + (size_t)b_idx * T * Hv;
    const StT* i_state = state_in + ((size_t)n * Dv + dv_idx) * Dk;
    StT* o_state = state_out + ((size_t)n * Dv + dv_idx) * Dk;
    float st[n_per_t];
    for (int i = 0; i < n_per_t; ++i) st[i] = static_cast<float>(i_state[n_per_t * lane + i]);
    for (int t = 0; t < T; ++t) {
      float gt = static_cast<float>(g_[hv_idx]);
      float kv = 0.0f;
      for (int i = 0; i < n_per_t; ++i) {
        st[i] = st[i] * gt;
        kv += st[i] * static_cast<float>(k_[n_per_t * lane + i]);
      }
      for (int o = 16; o > 0; o /= 2) kv += __shfl_xor_sync(0xffffffff, kv, o);
      float delta = (static_cast<float>(v_[dv_idx]) - kv) * static_cast<float>(beta_[hv_idx]);
      float out = 0.0f;
      for (int i = 0; i < n_per_t; ++i) {
        st[i] = st[i] + static_cast<float>(k_[n_per_t * lane + i]) * delta;
        out += st[i] * static_cast<float>(q_[n_per_t * lane + i]);
      }
      for (int o = 16; o > 0; o /= 2) out += __shfl_xor_sync(0xffffffff, out, o);
      if (lane == 0) y_[dv_idx] = static_cast<InT>(out);
      SAVE_STATE
      q_ += Hk * Dk; k_ += Hk * Dk; v_ += Hv * Dv; y_ += Hv * Dv; g_ += Hv; beta_ += Hv;
    }
    for (int i = 0; i < n_per_t; ++i) o_state[n_per_t * lane + i] = static_cast<StT>(st[i]);
"""
_SAVE = r"""
      { StT* s_ = states + (((size_t)t * gridDim.z + n) * Dv + dv_idx) * Dk;
        for (int i = 0; i < n_per_t; ++i) s_[n_per_t * lane + i] = static_cast<StT>(st[i]); }
"""
_INPUTS = ["q", "k", "v", "g", "beta", "state_in"]


def _cuda_kernels():
    if not mx.cuda.is_available():
        return None
    return {False: mx.fast.cuda_kernel("harness_gdn", _INPUTS, ["y", "state_out"], _SOURCE.replace("SAVE_STATE", "")),
            True: mx.fast.cuda_kernel("harness_gdn_states", _INPUTS, ["y", "state_out", "states"],
                                      _SOURCE.replace("SAVE_STATE", _SAVE))}


_KERNELS = _cuda_kernels()


def kernel_applies(q: mx.array, g: mx.array, mask) -> bool:
    """Whether the fused CUDA kernel runs these shapes on the current device."""
    return (_KERNELS is not None and mx.default_device() == mx.gpu and mask is None and g.ndim == 3
            and q.shape[-1] % 32 == 0)


def kernel_available() -> bool:
    """Whether this process runs the fused CUDA recurrence (anywhere else, mlx-lm's own code runs)."""
    return _KERNELS is not None and mx.default_device() == mx.gpu


def backend_path() -> str:
    """Which recurrence runs on the current device, for the record."""
    if mx.default_device() == mx.gpu and _KERNELS is not None:
        return "harness CUDA kernel (fused, per-step states on capture)"
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        return "mlx-lm Metal kernel (capture steps it one token at a time)"
    return "mlx-lm ops loop (CPU)"


def _kernel(q, k, v, g, beta, state, keep_states: bool):
    # q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk]
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    shapes = [(B, T, Hv, Dv), state.shape] + ([(T, *state.shape)] if keep_states else [])
    out = _KERNELS[keep_states](
        inputs=[q, k, v, g, beta, state],
        template=[("InT", q.dtype), ("GT", g.dtype), ("BT", beta.dtype), ("StT", state.dtype),
                  ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1), output_shapes=shapes,
        output_dtypes=[q.dtype, state.dtype] + ([state.dtype] if keep_states else []))
    return out[0], out[1], (out[2] if keep_states else None)  # states: [T, B, Hv, Dv, Dk]


def _metal(q) -> bool:
    return mx.default_device() == mx.gpu and mx.metal.is_available() and q.shape[-1] % 32 == 0


def _fallback(q, k, v, g, beta, state, mask):
    # mlx-lm's own path: its Metal kernel where it has one, else the ops loop.
    if _metal(q):
        return gd.gated_delta_kernel(q, k, v, g, beta, state, mask)
    return gd.gated_delta_ops(q, k, v, g, beta, state, mask)


_STEP = getattr(gd, "_gated_delta_step_ops", None)  # mlx-lm's compiled single step (private: may go away)


def _stepped_ops(q, k, v, g, beta, state, mask):
    # mlx-lm's ops loop written out, keeping the state after every step: the same compiled
    # step, so the same numbers as T single-token calls, without T-fold head repeats and stacks.
    Hk, Hv = q.shape[2], v.shape[2]
    if Hv // Hk > 1:
        q, k = mx.repeat(q, Hv // Hk, -2), mx.repeat(k, Hv // Hk, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = _STEP(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None if mask is None else mask[:, t])
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), state, states


def recurrence(q, k, v, g, beta, state, mask=None, keep_states: bool = False):
    """y [B, T, Hv, Dv], final state, and (keep_states) the state after every step, indexable by step."""
    if kernel_applies(q, g, mask):
        return _kernel(q, k, v, g, beta, state, keep_states)
    if not keep_states:
        return (*_fallback(q, k, v, g, beta, state, mask), None)
    if not _metal(q) and _STEP is not None:
        return _stepped_ops(q, k, v, g, beta, state, mask)
    ys, states = [], []
    for t in range(q.shape[1]):  # one step at a time: exactly what single-token decode computes
        s = slice(t, t + 1)
        y, state = _fallback(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], state,
                             None if mask is None else mask[:, s])
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), state, states


def gates(a, b, A_log, dt_bias, lower_bound=None, allow_neg_eigval=False):
    """(g, beta) exactly as mlx-lm's gated_delta_update derives them."""
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        return gd.compute_g(A_log, a, dt_bias), beta
    return gd.compute_lower_bound_g(A_log, a, dt_bias, lower_bound), beta


@dataclass
class Recorded:
    """What one hooked forward kept, one entry per recurrent layer in call order."""

    conv_inputs: dict = field(default_factory=dict)  # slot -> [B, kernel-1 + T, C]
    states: list = field(default_factory=list)  # capture: per layer, the state after each step
    inputs: list = field(default_factory=list)  # recompute: per layer, (q, k, v, g, beta, state before)


class _ConvTap(nn.Module):
    """Wraps a mixer's conv1d to keep its input: [B, kernel-1 + T, C]."""

    def __init__(self, conv: nn.Module, sink: Recorded, slot: int):
        super().__init__()
        self.conv = conv
        self.sink, self.slot = sink, slot

    def __call__(self, x):
        self.sink.conv_inputs[self.slot] = x
        return self.conv(x)


class RecurrenceHook:
    """Routes the recurrent layers of one model through `recurrence` during a forward."""

    MODES = ("plain", "capture", "recompute")

    def __init__(self, mixers: list[nn.Module]):
        self.mixers = mixers
        self.modules = sorted({sys.modules[type(m).__module__] for m in mixers}, key=lambda m: m.__name__)

    @contextmanager
    def __call__(self, mode: str = "plain"):
        assert mode in self.MODES, f"unknown recurrence mode {mode!r}"
        rec = Recorded()

        def update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, use_kernel=True, **kw):
            # q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; state: [B, Hv, Dv, Dk] or None
            g, beta = gates(a, b, A_log, dt_bias, **kw)
            if state is None:
                state = mx.zeros((q.shape[0], v.shape[2], v.shape[3], q.shape[3]), dtype=mx.float32)
            if mode == "recompute":
                rec.inputs.append((q, k, v, g, beta, state))
            y, state, states = recurrence(q, k, v, g, beta, state, mask, keep_states=mode == "capture")
            if mode == "capture":
                rec.states.append(states)
            return y, state

        taps = conv1d(self.mixers, lambda conv, slot: _ConvTap(conv, rec, slot)) if mode != "plain" else nullcontext()
        with gated_delta_update(self.modules, lambda _: update), taps:
            yield rec
