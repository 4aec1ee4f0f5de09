"""The few-row matmul kernel (engines/gemm.py): which nn.Linear calls reach it, that it is
refused where it cannot run, and (CUDA only) that it computes what mx.matmul does."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from engines import gemm
from engines.gemm import small_m_linears, small_m_matmul
from engines.target import Target
from harness.config import ConfigError, validate
from tests.test_config import cfg

CUDA = gemm.available()


def _recorder(calls):
    def matmul(x, w):
        calls.append(x.shape)
        return x @ w.T
    return matmul


def test_only_2_to_16_half_precision_rows_of_kernel_shapes_reach_the_kernel_and_the_class_is_restored():
    original = nn.Linear.__call__
    layer, odd = nn.Linear(256, 32), nn.Linear(100, 32)  # K = 256: one chunk per warp; K = 100: not a multiple
    layer.set_dtype(mx.bfloat16)
    odd.set_dtype(mx.bfloat16)
    calls = []
    with small_m_linears(True, _recorder(calls)):
        with small_m_linears(True, _recorder(calls)):  # nested: installed once, not twice
            assert nn.Linear.__call__ is not original
        for shape, dtype, routed in (((1, 8, 256), mx.bfloat16, True), ((16, 256), mx.bfloat16, True),
                                     ((2, 256), mx.bfloat16, True), ((1, 1, 256), mx.bfloat16, False),
                                     ((17, 256), mx.bfloat16, False), ((8, 256), mx.float32, False)):
            calls.clear()
            x = mx.random.normal(shape).astype(dtype)
            y = layer(x)
            assert y.shape == (*shape[:-1], 32) and (len(calls) == 1) == routed, (shape, dtype, calls)
        calls.clear()
        odd(mx.zeros((8, 100), dtype=mx.bfloat16))
        assert calls == []
    assert nn.Linear.__call__ is original


def test_the_routed_linear_keeps_its_bias():
    layer = nn.Linear(256, 16, bias=True)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((4, 256)).astype(mx.bfloat16)
    want = x @ layer.weight.T + layer.bias
    with small_m_linears(True, lambda a, w: a @ w.T):
        got = layer(x)
    assert mx.array_equal(got, want).item()


@pytest.mark.skipif(CUDA, reason="off-CUDA refusal")
def test_forcing_the_kernel_where_there_is_no_cuda_is_refused_in_one_line(models):
    with pytest.raises(ValueError, match="CUDA"):
        Target(models["llama"][0], small_m_gemm=True)
    with pytest.raises(ConfigError, match="dispatch.small_m_gemm=true needs MLX's CUDA backend"):
        validate(cfg("dispatch.small_m_gemm=true"))


@pytest.mark.skipif(not CUDA, reason="the kernel is CUDA only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("m", [2, 5, 8, 9, 16])
def test_the_kernel_computes_the_matmul_to_half_precision_rounding(m, dtype):
    for n, k in ((32, 256), (512, 2048), (2064, 768)):
        x = mx.random.normal((m, k)).astype(dtype)
        w = (mx.random.normal((n, k)) * k ** -0.5).astype(dtype)
        want, got = (x @ w.T).astype(mx.float32), small_m_matmul(x, w).astype(mx.float32)
        scale = mx.abs(want).max().item()
        assert mx.abs(got - want).max().item() <= 2 ** -7 * scale, (m, n, k, dtype)
