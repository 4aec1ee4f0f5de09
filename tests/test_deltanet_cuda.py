"""The fused CUDA recurrence against mlx-lm's ops loop (runs only where MLX has CUDA).

The CPU suite covers the fallback path (mlx-lm's own code) through every rollback
test; this file is what checks the GPU-only kernel, on the device machine:
`python -m pytest -q tests/test_deltanet_cuda.py`.
"""

import mlx.core as mx
import pytest
from mlx_lm.models import gated_delta as gd

from engines.kernels import deltanet

pytestmark = pytest.mark.skipif(not mx.cuda.is_available(), reason="the fused recurrence is CUDA-only")


def _inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0):
    mx.random.seed(seed)
    q = (mx.random.normal((B, T, Hk, Dk)) * 0.1).astype(dtype)
    k = (mx.random.normal((B, T, Hk, Dk)) * 0.1).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv))
    beta = mx.random.uniform(shape=(B, T, Hv)).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("shape", [(1, 1, 16, 16, 128, 128), (1, 8, 16, 16, 128, 128), (1, 5, 2, 4, 64, 32),
                                   (2, 3, 4, 8, 32, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fused_recurrence_matches_the_ops_loop_and_keeps_every_step(shape, dtype):
    q, k, v, g, beta, state = _inputs(*shape, dtype)
    assert deltanet.kernel_applies(q, g, None)
    y, final, states = deltanet.recurrence(q, k, v, g, beta, state, keep_states=True)
    y_ref, final_ref = gd.gated_delta_ops(q, k, v, g, beta, state)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.allclose(y.astype(mx.float32), y_ref.astype(mx.float32), atol=tol, rtol=tol).item()
    assert mx.allclose(final, final_ref, atol=1e-5, rtol=1e-5).item()
    s = state
    for t in range(q.shape[1]):  # the state after every step, as single-token decode would leave it
        _, s = gd.gated_delta_ops(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], s)
        assert mx.allclose(states[t], s, atol=1e-5, rtol=1e-5).item(), t
    assert mx.array_equal(states[-1], final).item()


def test_one_step_at_a_time_equals_the_multi_step_kernel_bit_for_bit():
    # Decode runs the kernel with T=1, verify with T=K+1: the per-step arithmetic is the same.
    q, k, v, g, beta, state = _inputs(1, 6, 16, 16, 128, 128, mx.bfloat16)
    y, final, _ = deltanet.recurrence(q, k, v, g, beta, state)
    s, ys = state, []
    for t in range(6):
        yt, s, _ = deltanet.recurrence(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], s)
        ys.append(yt)
    assert mx.array_equal(mx.concatenate(ys, axis=1), y).item() and mx.array_equal(s, final).item()
