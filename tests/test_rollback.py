"""Rollback exactness: after draft + verify + rollback, every cache equals a fresh run."""

import random

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.qwen3_5 as qwen3_5
import pytest
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

from engines.runtime.cache import ROLLBACK_STRATEGIES, CastKVCache, RollbackError, logical_state, trim_attention
from engines.runtime.hidden import hidden_size, num_layers
from engines.runtime.target import Target
from tests.conftest import ARCHS

# The CPU computes a verify's kept rows and a fresh feed of them bit for bit alike. MLX's CUDA GEMMs
# round by row count: on the H100 (2026-12-05) qwen35's states after 12 rounds differed by 1.1e-5
# in float32, and 16-bit storage rounded such inputs apart by one of its ulps (fp16 9.8e-4, bf16
# 7.8e-3 at values in [1, 2)). A rollback that kept one wrong token differs by ~4.4 (states reach ~6).
CUDA = mx.default_device() == mx.gpu and mx.cuda.is_available()
TOL = 1e-4 if CUDA else 1e-5


def _max_diff(a: Target, b: Target) -> float:
    """Largest |a - b| over every cache's logical state, less (on CUDA) one ulp of its storage at |b|."""
    worst = 0.0
    assert a.offset == b.offset
    for ca, cb in zip(a.cache, b.cache, strict=True):
        for x, y in zip(logical_state(ca), logical_state(cb), strict=True):
            assert x.shape == y.shape, f"{type(ca).__name__}: {x.shape} vs {y.shape}"
            if x.size:
                ulp = mx.finfo(x.dtype).eps if CUDA and x.dtype in (mx.float16, mx.bfloat16) else 0.0
                x, y = x.astype(mx.float32), y.astype(mx.float32)
                worst = max(worst, (mx.abs(x - y) - ulp * mx.abs(y)).max().item())
    return worst


def _scenario(model, strategy, kv, prompt, rounds):
    """Run verify/commit rounds; return the rolled-back target and a fresh one fed only what was kept."""
    t = Target(model, kv=kv, rollback=strategy)
    fresh = Target(model, kv=kv, rollback=strategy)
    t.prefill(prompt)
    fresh.prefill(prompt)
    for tokens, n_keep in rounds:
        t.verify(tokens)
        t.commit(n_keep)
        fresh.forward(tokens[:n_keep])  # the accepted prefix, fed as one chunk like the verify
    return t, fresh


@pytest.mark.parametrize("strategy", list(ROLLBACK_STRATEGIES))
@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_restores_every_cache_to_a_fresh_run_over_the_accepted_prefix(models, arch, strategy):
    model, _ = models[arch]
    rng = random.Random(7)
    for prompt_len in (5, 40):  # 40 > gemma's window of 32: the window has already wrapped
        prompt = [rng.randrange(1000) for _ in range(prompt_len)]
        rounds = []
        for _ in range(12):  # 12 rounds of up to 6 tokens: wraps the window again
            T = rng.choice([2, 4, 6])
            rounds.append(([rng.randrange(1000) for _ in range(T)], rng.randint(1, T)))
        t, fresh = _scenario(model, strategy, "native", prompt, rounds)
        assert _max_diff(t, fresh) <= TOL
        # ... and the next forward agrees too
        assert mx.abs(t.verify([5, 6]).logits - fresh.forward([5, 6]).logits).max().item() <= 1e-4


@pytest.mark.parametrize("n_keep", [1, 2, 3, 4, 5])
def test_hybrid_rollback_to_each_position_of_a_block(models, n_keep):
    model, _ = models["qwen35"]
    prompt = list(range(100, 130))
    block = [11, 22, 33, 44, 55]
    for strategy in ROLLBACK_STRATEGIES:
        t, fresh = _scenario(model, strategy, "native", prompt, [(block, n_keep)])
        assert _max_diff(t, fresh) <= TOL, strategy
        # recurrent state: both the conv window and the DeltaNet state are compared
        assert any(len(logical_state(c)) == 2 and logical_state(c)[1].ndim == 4 for c in t.cache)


CONVERTED = {"q8": (QuantizedKVCache, 8), "q4": (QuantizedKVCache, 4), "float16": (CastKVCache, mx.float16),
             "bfloat16": (CastKVCache, mx.bfloat16)}


# Attention only and hybrid: both compute the kept positions bit for bit alike in a verify and in a
# fresh feed, so storage rounding cannot split them (gemma's float32 forwards differ by ~1e-6
# between chunk sizes, which 16-bit storage rounds apart by an ulp).
@pytest.mark.parametrize("kv", list(CONVERTED))
@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_rollback_is_exact_under_converted_kv_caches(models, arch, kv):
    if CUDA and kv in ("q4", "q8"):  # measured on the H100 at 66ef0ef, mlx 0.32.4
        pytest.skip("MLX's CUDA quantized_matmul has no kernel for a float32 target's quantized KV cache "
                    "(\"No implementation for problem shape: 1x42x64x4 ... activation: float32\")")
    model, _ = models[arch]
    rng = random.Random(5)
    rounds = [([rng.randrange(1000) for _ in range(T)], rng.randint(1, T)) for T in (4, 3, 2, 5, 5, 4, 6, 3)]
    t, fresh = _scenario(model, "capture", kv, list(range(200, 240)), rounds)
    kind, storage = CONVERTED[kv]  # the cache under test is the converted one, not a native stand-in
    converted = [c for c in t.cache if type(c) is kind]
    assert converted and all((c.bits if kind is QuantizedKVCache else c.storage_dtype) == storage for c in converted)
    assert _max_diff(t, fresh) <= TOL
    # ... and the next forward reads the rolled-back cache as the fresh one (on CUDA a 16-bit cache's
    # one-ulp splits above reach the logits: fp16 read 1.18e-4 on the H100; a wrong token moves them ~1)
    logit_tol = 1e-3 if CUDA and kv in ("float16", "bfloat16") else 1e-4
    assert mx.abs(t.verify([5, 6]).logits - fresh.forward([5, 6]).logits).max().item() <= logit_tol


def test_sliding_window_rollback_many_rounds_past_the_window(models):
    model, _ = models["gemma4"]
    rng = random.Random(3)
    rounds = [([rng.randrange(1000) for _ in range(5)], rng.randint(1, 5)) for _ in range(30)]
    t, fresh = _scenario(model, "capture", "native", [rng.randrange(1000) for _ in range(33)], rounds)
    windows = [c for c in t.cache if isinstance(c, RotatingKVCache)]
    assert windows and all(c.offset > 3 * c.max_size for c in windows)
    assert _max_diff(t, fresh) <= TOL


def test_rotating_rollback_raises_when_the_window_lost_history():
    c = RotatingKVCache(max_size=8)
    for _ in range(20):  # single-token updates rotate in place: only 8 positions are kept
        c.update_and_fetch(mx.ones((1, 1, 1, 4)), mx.ones((1, 1, 1, 4)))
    trim_attention(c, 1)  # 7 positions left: still enough for the next query
    with pytest.raises(RollbackError, match="lost history"):
        trim_attention(c, 1)


def test_trimming_more_than_the_cache_holds_raises(models):
    t = Target(models["llama"][0])
    t.prefill([1, 2, 3])
    t.verify([4, 5])
    with pytest.raises(RollbackError):
        t.commit(0)


@pytest.mark.parametrize("strategy", ["capture", "recompute"])
def test_recurrence_hooks_leave_no_patch_behind(models, strategy):
    model, _ = models["qwen35"]
    original = qwen3_5.gated_delta_update
    t = Target(model, rollback=strategy)
    t.prefill([1, 2, 3, 4])
    t.verify([5, 6, 7])
    t.commit(2)
    assert qwen3_5.gated_delta_update is original
    assert all(type(layer.linear_attn.conv1d) is nn.Conv1d for layer in model.layers if layer.is_linear)


@pytest.mark.parametrize("arch", ARCHS)
def test_rewind_to_a_mark_restores_the_cache_exactly(models, arch):
    # Calibration times verifies from one fixed cache: rewind must be exact there too.
    model, _ = models[arch]
    prompt = list(range(100, 140))
    t, fresh = Target(model), Target(model)
    t.prefill(prompt)
    fresh.prefill(prompt)
    mark = t.mark()
    for n in (3, 6, 1):
        t.verify(list(range(n)))
        t.rewind(mark)
    assert _max_diff(t, fresh) <= TOL
    assert mx.abs(t.verify([5, 6]).logits - fresh.forward([5, 6]).logits).max().item() <= 1e-4


@pytest.mark.parametrize("hk, hv, masked", [(2, 2, False), (2, 4, False), (2, 4, True)])
def test_capture_steps_equal_single_token_recurrences_bit_for_bit(hk, hv, masked):
    # What capture keeps must be what T single-token decodes would have computed on this device:
    # the fused kernel on CUDA, mlx-lm's ops elsewhere (mlx-lm's ops are not the CUDA reference:
    # on the H100 they differed from the kernel in the last digit, 2026-12-05).
    from engines.kernels.deltanet import recurrence

    B, T, D = 1, 6, 32
    mx.random.seed(3)
    q, k = mx.random.normal((B, T, hk, D)), mx.random.normal((B, T, hk, D))
    v = mx.random.normal((B, T, hv, D))
    g, beta = mx.sigmoid(mx.random.normal((B, T, hv))), mx.sigmoid(mx.random.normal((B, T, hv)))
    state = mx.random.normal((B, hv, D, D))
    mask = mx.array([[True, True, False, True, True, True]]) if masked else None
    y, final, states = recurrence(q, k, v, g, beta, state, mask, keep_states=True)
    s = state
    for t in range(T):
        yt, s, _ = recurrence(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1], s,
                              None if mask is None else mask[:, t:t + 1])
        assert mx.array_equal(yt, y[:, t:t + 1]).item() and mx.array_equal(s, states[t]).item(), t
    assert mx.array_equal(s, final).item()


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_verify_returns_the_declared_layers_hidden_states_and_a_replay_commit_leaves_them_alone(models, arch):
    # The hidden states come back with the logits of the call that fed those tokens; the replay
    # commit that re-runs the target over the kept tokens afterwards cannot change them.
    model, _ = models[arch]
    layers, H, prompt = (0, num_layers(model) - 1), hidden_size(model), list(range(10, 30))
    t, fresh = Target(model, rollback="replay", hidden_layers=layers), Target(model, hidden_layers=layers)
    logits, hidden = t.prefill(prompt)
    assert logits.shape == (t.vocab_size,) and hidden.shape == (1, len(prompt), 2 * H)
    fresh.prefill(prompt)
    logits, hidden = t.verify([5, 6, 7, 8])
    t.commit(2)
    want_logits, want_hidden = fresh.forward([5, 6, 7, 8])
    assert hidden.shape == (1, 4, 2 * H) and logits.shape == (4, t.vocab_size)
    assert mx.abs(hidden - want_hidden).max().item() <= 1e-4
    assert mx.abs(logits - want_logits).max().item() <= 1e-4
    assert Target(model).verify([1, 2]).hidden is None  # no layers declared, none kept
    with pytest.raises(AttributeError):
        t.hidden_layers = (1,)  # declared when built, not set later
