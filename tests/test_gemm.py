"""The few-row matmul kernel (engines/kernels/gemm.py): which nn.Linear calls reach it, that it is
refused where it cannot run, and (CUDA only) that it computes what mx.matmul does."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from engines.kernels import gemm
from engines.kernels.gemm import grouped_matmul, small_m_linears, small_m_matmul
from engines.runtime.target import Target
from harness.config import validate
from harness.errors import ConfigError
from tests.conftest import engine_cfg
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
        narrow = nn.Linear(576, 32)  # SmolLM2's width: a multiple of 32, not of 256 (6 warps split it)
        narrow.set_dtype(mx.bfloat16)
        narrow(mx.zeros((8, 576), dtype=mx.bfloat16))
        assert calls == [(8, 576)]
    assert nn.Linear.__call__ is original


def test_warps_split_k_into_whole_32_wide_chunks():
    assert [gemm.warps_for(k) for k in (2048, 1536, 576, 96, 160, 32)] == [8, 8, 6, 3, 1, 1]


def test_one_compiled_kernel_serves_every_row_count_of_its_8_row_bucket():
    # NVRTC compiles per distinct template; a row count in it cost a SmolLM2 cell > 100 s of compiles
    shapes = [(m, 576) for m in range(2, 17)] + [(1, m, 576) for m in range(2, 17)]
    templates = {str(gemm.template(s, (576, 192, 192), mx.bfloat16)) for s in shapes}
    assert len(templates) == 2
    assert [gemm.row_tiles(m) for m in (2, 8, 9, 16)] == [1, 1, 2, 2]


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
    for n, k in ((32, 256), (512, 2048), (2064, 768), (576, 576), (192, 1536), (48, 96)):  # 8, 8, 8, 6, 8, 3 warps
        x = mx.random.normal((m, k)).astype(dtype)
        w = (mx.random.normal((n, k)) * k ** -0.5).astype(dtype)
        want, got = (x @ w.T).astype(mx.float32), small_m_matmul(x, w).astype(mx.float32)
        scale = mx.abs(want).max().item()
        assert mx.abs(got - want).max().item() <= 2 ** -7 * scale, (m, n, k, dtype)


@pytest.mark.skipif(not CUDA, reason="the kernel is CUDA only")
@pytest.mark.parametrize("m", [2, 8, 16])
def test_a_grouped_launch_gives_each_weight_exactly_what_its_own_launch_gives(m):
    x = mx.random.normal((m, 2048)).astype(mx.bfloat16)
    ws = [(mx.random.normal((n, 2048)) * 2048 ** -0.5).astype(mx.bfloat16) for n in (2048, 512, 512)]
    for got, w in zip(grouped_matmul(x, ws), ws):
        assert mx.array_equal(got, small_m_matmul(x, w)).item(), w.shape
    a, b = grouped_matmul(x, ws[1:])
    assert mx.array_equal(a, small_m_matmul(x, ws[1])).item() and mx.array_equal(b, small_m_matmul(x, ws[2])).item()
    x6 = mx.random.normal((m, 576)).astype(mx.bfloat16)  # 6 warps: rows past 12 take a second pass
    w6 = [(mx.random.normal((n, 576)) * 576 ** -0.5).astype(mx.bfloat16) for n in (576, 192, 192)]
    for got, w in zip(grouped_matmul(x6, w6), w6):
        assert mx.array_equal(got, small_m_matmul(x6, w)).item(), w.shape
    # a [1, T, K] input (what a forward passes) keeps its leading dims, with the same values
    for got, flat in zip(grouped_matmul(x[None], ws), grouped_matmul(x, ws)):
        assert got.shape == (1, *flat.shape) and mx.array_equal(got[0], flat).item()


def _emulated(log):
    # the kernel emulated by a plain matmul; log gets one entry per launch: the widths it covered
    def single(x, w):
        log.append((w.shape[0],))
        return x @ w.T

    def grouped(x, ws):
        log.append(tuple(w.shape[0] for w in ws))
        return [x @ w.T for w in ws]
    return single, grouped


def test_linears_that_read_one_input_in_turn_are_learned_then_launched_as_one(models, monkeypatch):
    model = models["llama"][0]
    forget = lambda: [vars(m).pop("_sm_group", None) for _, m in model.named_modules()]
    forget()  # runs other tests' forwards taught this shared fixture model
    monkeypatch.setattr(gemm, "takes", lambda rows, w, dtype: 2 <= rows <= gemm.MAX_ROWS)
    ids = mx.array([[5, 6, 7, 8]])
    want = model(ids)  # no routing at all
    a = model.layers[0].self_attn
    q, k, v, o = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0], a.v_proj.weight.shape[0], a.o_proj.weight.shape[0]
    gate, up = model.layers[0].mlp.gate_proj.weight.shape[0], model.layers[0].mlp.up_proj.weight.shape[0]
    down, head = model.layers[0].mlp.down_proj.weight.shape[0], model.lm_head.weight.shape[0]
    for fresh in (True, False):
        log = []
        with small_m_linears(True, *_emulated(log)):
            got = model(ids)
        assert mx.array_equal(got, want).item()
        n = len(model.layers)
        if fresh:  # the first forward learns: every linear alone
            assert log == [(q,), (k,), (v,), (o,), (gate,), (up,), (down,)] * n + [(head,)]
        else:  # then q/k/v and gate/up go as one launch each, and nothing is computed twice
            assert log == [(q, k, v), (o,), (gate, up), (down,)] * n + [(head,)]
    # a member's output is handed over only for the very input its launcher saw
    x, y = mx.random.normal((4, a.q_proj.weight.shape[1])), mx.random.normal((4, a.q_proj.weight.shape[1]))
    log = []
    with small_m_linears(True, *_emulated(log)):
        a.q_proj(x)
        got_k, got_v = a.k_proj(y), a.v_proj(x)
    assert log == [(q, k, v), (k,)]
    assert mx.array_equal(got_k, y @ a.k_proj.weight.T).item()
    assert mx.array_equal(got_v, x @ a.v_proj.weight.T).item()
    assert all(vars(m).get("_sm_stash") is None for m in (a.q_proj, a.k_proj, a.v_proj))  # nothing held after the block
    forget()


def _engines(model, arch):
    
    from engines.methods.dflash import DFlashA
    from engines.methods.eagle3 import Eagle3
    from engines.methods.mtp import MTP
    from harness.models import fixtures
    from tests.test_eagle3 import eagle_cfg
    from tests.test_mtp import mtp_cfg

    dflash = engine_cfg(block_size=None, drafter=str(fixtures.drafter_dir("dflash", arch)), verify="batched")
    yield "dflash_a", lambda **kw: DFlashA.build(model, dflash, **kw)
    if arch == "llama":
        yield "eagle3", lambda **kw: Eagle3.build(model, eagle_cfg(arch), **kw)
    if arch == "qwen35":
        yield "mtp", lambda **kw: MTP.build(model, mtp_cfg(fixtures.fixture_dir("qwen35"), 3), **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_drafting_engines_send_their_verify_and_draft_matmuls_to_the_kernel_and_keep_their_output(
        models, monkeypatch, arch):
    # The kernel is emulated by the matmul nn.Linear itself runs (float32, any K): what is
    # tested is which forwards reach it, and that routing alone changes nothing.
    from tests.helpers import generate_ids

    model, tok = models[arch]
    ids = tok.encode("def add(a, b):")
    calls = {"verify": 0, "draft": 0, "grouped verify": 0, "grouped draft": 0}
    phase = ["draft"]
    monkeypatch.setattr("engines.runtime.target.gemm_available", lambda: True)
    monkeypatch.setattr(gemm, "takes", lambda rows, w, dtype: 2 <= rows <= gemm.MAX_ROWS)

    def matmul(x, w):
        calls[phase[0]] += 1
        return x @ w.T

    def grouped(x, ws):
        calls[f"grouped {phase[0]}"] += 1
        return [x @ w.T for w in ws]
    monkeypatch.setattr(gemm, "small_m_matmul", matmul)
    monkeypatch.setattr(gemm, "grouped_matmul", grouped)
    for name, make in _engines(model, arch):
        plain = generate_ids(make(small_m_gemm=False), ids, 24)
        eng = make(small_m_gemm=True)
        verify, draft = eng.verify, eng.draft

        def in_phase(label, fn):
            def run(*a):
                phase[0] = label
                return fn(*a)
            return run
        eng.verify, eng.draft = in_phase("verify", verify), in_phase("draft", draft)
        calls.update({c: 0 for c in calls})
        routed = generate_ids(eng, ids, 24)
        assert routed.tokens == plain.tokens, name
        assert [r.accepted for r in routed.rounds] == [r.accepted for r in plain.rounds], name
        assert all(calls[c] > 0 for c in ("verify", "draft", "grouped verify")), (name, calls)
