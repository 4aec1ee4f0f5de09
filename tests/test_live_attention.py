"""One-token static attention: the live-length kernel (CUDA) and what it must equal.

On the CPU: `reference` (what the kernel computes, in MLX ops) equals attention over exactly the
live keys, the swap stays out where the kernel does not run, and a static target records which
attention it ran. On CUDA (the device: `python -m pytest -q tests/test_live_attention.py`): the
kernel equals the reference for GQA, windows, every buffer fill and both dtypes, and a static
base decodes base's tokens with it.
"""

import mlx.core as mx
import pytest

from engines.kernels import live_attention as la
from engines.methods.device import StaticBase
from engines.runtime.sampling import Sampler
from harness.config import MethodConfig
from harness.generation import run_generation
from tests.helpers import base_tokens

cuda = pytest.mark.skipif(not la.kernel_available(), reason="the live-length kernel is CUDA-only")


def _qkv(hq, hkv, C, D, dtype, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((1, hq, 1, D)).astype(dtype), mx.random.normal((1, hkv, C, D)).astype(dtype),
            mx.random.normal((1, hkv, C, D)).astype(dtype))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("length", [1, 7, 64])
def test_the_reference_attends_exactly_the_live_keys(length, window):
    q, k, v = _qkv(4, 2, 64, 32, mx.float32)
    got = la.reference(q, k, v, mx.array(length), 0.125, window)
    lo = max(0, length - window) if window else 0
    want = mx.fast.scaled_dot_product_attention(q, k[:, :, lo:length], v[:, :, lo:length], scale=0.125)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_the_swap_is_a_no_op_where_the_kernel_does_not_run(models):
    if la.kernel_available():
        pytest.skip("the kernel runs here: the CUDA tests below cover it")
    model, _ = models["llama"]
    target = StaticBase.build(model, MethodConfig(name="base")).target
    assert target.attention == "masked sdpa over the buffer" and target._attention == []
    assert not la.applies(*_qkv(4, 2, 8, 32, mx.float32)[:2])
    assert isinstance(la.live_attention([object()], object), type(la.nullcontext()))


def test_a_static_record_names_its_attention(models):
    model, _ = models["llama"]
    eng = StaticBase.build(model, MethodConfig(name="base"))
    want = "live-length CUDA kernel" if la.kernel_available() else "masked sdpa over the buffer"
    assert eng.describe()["attention"] == want


@cuda
@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
@pytest.mark.parametrize("hq,hkv,D", [(9, 3, 64), (8, 8, 128), (4, 1, 256), (2, 2, 32)])
@pytest.mark.parametrize("window", [None, 6])
def test_the_kernel_equals_the_reference_at_every_fill(dtype, tol, hq, hkv, D, window):
    q, k, v = _qkv(hq, hkv, 80, D, dtype)
    for length in (1, 2, 5, 31, 32, 33, 79, 80, 200):  # 200: past the buffer, clamped like the writes
        got = la.attend(q, k, v, mx.array(length), D ** -0.5, window)
        want = la.reference(q, k, v, mx.array(min(length, 80)), D ** -0.5, window)
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item(), length


@cuda
def test_a_static_base_on_the_kernel_decodes_base_tokens_with_one_trace_per_shape(models):
    model, _ = models["llama"]
    eng = StaticBase.build(model, MethodConfig(name="base"))
    assert eng.target.attention == "live-length CUDA kernel"
    ids = [5, 6, 7, 8, 9, 10]
    got = run_generation(eng, ids, 40, Sampler(0.0, 0)).tokens
    assert got == base_tokens(model, ids, 40)
    traces = eng.target.traces
    run_generation(eng, ids[:4], 40, Sampler(0.0, 0))
    assert eng.target.traces == traces  # a second generation in the same buffer bucket: no new trace
