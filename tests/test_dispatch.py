"""Staged dispatch and shape-stable attention (engines/runtime/dispatch.py), forced on on the CPU:
they change how work reaches the device, never what is computed."""


import mlx.core as mx
import pytest

import engines.runtime.dispatch as dispatch
from engines.methods.autoregressive import Autoregressive
from engines.methods.dflash import DFlashA
from engines.methods.eagle3 import Eagle3
from engines.methods.mtp import MTP
from engines.methods.ngram import Ngram
from engines.runtime.dispatch import attention_modules
from engines.runtime.hidden import decoder
from engines.runtime.target import Target
from harness.models import fixtures
from tests.conftest import engine_cfg, method_cfg
from tests.helpers import base_tokens, generate_ids
from tests.test_eagle3 import eagle_cfg
from tests.test_lossless import NEW_TOKENS, _units
from tests.test_mtp import mtp_cfg

FORCED = {"stage_every": 1, "stable_attention": True}


def _dflash(model, arch, **kw):
    return DFlashA.build(model, engine_cfg(block_size=None, drafter=str(fixtures.drafter_dir("dflash", arch))), **kw)


@pytest.mark.parametrize("device, cuda_build, on", [
    ("cpu", False, False),  # the CPU build
    ("cpu", True, False),  # a CUDA build running on its CPU device
    ("gpu", False, False),  # Metal
    ("gpu", True, True),  # a CUDA GPU
])
def test_stable_attention_and_small_m_gemm_are_the_default_under_cuda_only_and_staging_never(monkeypatch, device,
                                                                                           cuda_build, on):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(getattr(mx, device)))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda_build)
    assert dispatch.dispatch_defaults() == {"stage_every": 0, "stable_attention": on, "small_m_gemm": on,
                                            "fuse_rounds": False}  # off until measured to pay (engines/methods/device.py)


def test_a_target_takes_the_devices_defaults_unless_told_otherwise(models, monkeypatch):
    import engines.runtime.target

    monkeypatch.setattr(engines.runtime.target, "dispatch_defaults",
                        lambda: {"stage_every": 3, "stable_attention": True, "small_m_gemm": False})
    model = models["llama"][0]
    t = Target(model)
    assert (t.stage_every, t.stable_attention, t.small_m_gemm) == (3, True, False)
    t = Target(model, stage_every=0, stable_attention=False)
    assert (t.stage_every, t.stable_attention) == (0, False)


@pytest.mark.parametrize("arch", ["llama", "qwen35", "gemma4"])
def test_forced_on_every_method_keeps_base_output_and_the_same_rounds(models, arch):
    model, tok = models[arch]
    layers = list(decoder(model).layers)
    sdpa = {m.__name__: m.scaled_dot_product_attention for m in attention_modules(model)}
    for _, ids in list(_units(tok))[::6]:
        want = base_tokens(model, ids, NEW_TOKENS)
        assert generate_ids(Autoregressive(Target(model, **FORCED), engine_cfg(name="base")), ids, NEW_TOKENS).tokens == want
        plain, forced = generate_ids(_dflash(model, arch), ids, NEW_TOKENS), generate_ids(_dflash(model, arch, **FORCED),
                                                                                          ids, NEW_TOKENS)
        assert forced.tokens == want == plain.tokens
        assert [r.accepted for r in forced.rounds] == [r.accepted for r in plain.rounds]  # the drafter drafted alike
        ngram = Ngram(Target(model, **FORCED), method_cfg(block_size=4))
        assert generate_ids(ngram, ids, NEW_TOKENS).tokens == want
        drafters = [lambda **kw: Eagle3.build(model, eagle_cfg(arch), **kw)]  # a tree (a chain on the hybrid)
        if arch == "qwen35":  # the fixture with an MTP head
            drafters.append(lambda **kw: MTP.build(model, mtp_cfg(fixtures.fixture_dir(arch), k=2), **kw))
        for build in drafters:
            plain, forced = generate_ids(build(), ids, NEW_TOKENS), generate_ids(build(**FORCED), ids, NEW_TOKENS)
            assert forced.tokens == want == plain.tokens
            assert [r.accepted for r in forced.rounds] == [r.accepted for r in plain.rounds]
    assert list(decoder(model).layers) == layers  # every stage hook was taken out again
    assert {m.__name__: m.scaled_dot_product_attention for m in attention_modules(model)} == sdpa


def _spy_attention(monkeypatch, note) -> list:
    """Every fused attention call appends note(q, k, mask) to the returned list, then runs as it would."""
    seen, real = [], mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, mask=None, **kw: seen.append(note(q, k, mask)) or real(q, k, v, mask=mask, **kw))
    return seen


def test_bucketed_attention_reads_the_whole_buffer_and_gives_the_same_logits(models, monkeypatch):
    model, tok = models["llama"]
    ids = next(_units(tok))[1]
    seen = _spy_attention(monkeypatch, lambda q, k, mask: k.shape[2])
    logits = {}
    for on in (False, True):
        t = Target(model, stable_attention=on)
        t.prefill(ids)
        seen.clear()
        logits[on] = t.verify([5, 6, 7, 8, 9, 10]).logits
        mx.eval(logits[on])
        assert set(seen) == ({256} if on else {len(ids) + 6}), seen  # the 256-key buffer, or the exact key count
    assert mx.abs(logits[True] - logits[False]).max().item() < 1e-5


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_forced_on_drafters_and_tree_verify_attend_over_whole_buffers(models, monkeypatch, method):
    # EAGLE-3's tree verify (a boolean tree mask), its drafter's own attention and the MTP head
    # (a layer of the target's class, run outside target forwards) all see the 256-key buffer
    arch = "llama" if method == "eagle3" else "qwen35"
    model, tok = models[arch]
    ids = next(_units(tok))[1]
    seen = _spy_attention(monkeypatch, lambda q, k, mask: (q.shape[2], k.shape[2]))
    cfg = eagle_cfg(arch) if method == "eagle3" else mtp_cfg(fixtures.fixture_dir(arch), k=2)
    engine = (Eagle3 if method == "eagle3" else MTP).build(model, cfg, **FORCED)
    generate_ids(engine, ids, 24)
    many = {k for t, k in seen if t > 1}
    assert len(ids) + 24 < 256 and many == {256}, many  # never an exact key count: one cuDNN plan per bucket


def test_staged_dispatch_queues_the_graph_every_n_layers(models, monkeypatch):
    model, tok = models["llama"]
    queued = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: queued.append(len(a)) or real(*a))
    n = len(decoder(model).layers)
    for every, expect in ((0, 0), (1, n - 1), (2, (n - 1) // 2)):
        queued.clear()
        mx.eval(Target(model, stage_every=every).prefill([1, 2, 3, 4]).logits)
        assert len(queued) == expect, (every, queued)  # never after the last layer: the caller evaluates that


def test_report_names_cells_that_set_dispatch_apart():
    from report.frames import _keys

    rec = {"cell_id": "x", "cell": {"method": {"name": "dflash_a", "block_size": 8}, "kv": {"name": "native"},
                                   "reference": "dflash_zlab"}}
    assert _keys(rec, {"x": ("llama", "")})["method"] == "dflash_a vs dflash_zlab"
    rec["cell"]["dispatch"] = {"stage_every": 4}
    assert _keys(rec, {"x": ("llama", "")})["method"] == "dflash_a vs dflash_zlab [stage_every=4]"


def test_a_tree_verify_passes_one_additive_mask_to_every_layer(models, monkeypatch):
    # MLX's CUDA attention converts a boolean mask in every call; the bucketed path converts it once
    model, tok = models["llama"]
    ids = next(_units(tok))[1]
    masks = _spy_attention(monkeypatch, lambda q, k, mask: mask)
    logits = {}
    for on in (False, True):
        t = Target(model, stable_attention=on)
        t.prefill(ids)
        masks.clear()
        logits[on] = t.verify_tree([5, 6, 7, 8, 9], [-1, 0, 0, 1]).logits
        mx.eval(logits[on])
    assert len(masks) == len(decoder(model).layers) and len({id(m) for m in masks}) == 1
    assert masks[0].dtype == mx.float32 and masks[0].shape[-1] == 256  # the fixture computes in float32
    assert mx.array_equal(logits[True], logits[False]).item()
