"""execution=static for DFlash A (engines/methods/dflash.py DFlashAStatic): greedy-lossless in float32 on
the llama and gemma4 fixtures, drafting what the eager DFlashA drafts round for round, its drafter's
static cache equal to the eager drafter's cache up to its position, one host read per round, one
compiled trace per shape, and sampling equal to the eager engine's sample for sample."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from engines.drafters.dflash import DFlashConfig, DFlashDrafter, save_drafter
from engines.methods.device import StaticBase
from engines.methods.dflash import DFlashA, DFlashAStatic
from engines.registry import get_engine
from engines.runtime.hidden import embed, lm_head
from engines.runtime.sampling import Sampler
from harness.generation import run_generation
from harness.models.fixtures import DFLASH, drafter_dir
from tests.conftest import engine_cfg
from tests.helpers import same_cache_values
from tests.test_lossless import _units

N = 32  # new tokens per generation


def _cfg(arch: str, block_size: int | None = 4):
    return engine_cfg(name="dflash_a", block_size=block_size, drafter=str(drafter_dir("dflash", arch)))


UNITS = ("explainer-1/0", "math-2/0", "explainer-3/0")  # built-in prompts where the fixture drafter keeps 0..3 drafts


def _prompts(tok, n: int = 3) -> list[list[int]]:
    ids = dict(_units(tok))
    return [ids[u] for u in UNITS[:n]]


def _run(engine, prompt, n=N, sampler=None):
    return run_generation(engine, prompt, n, sampler or Sampler(0.0, 0))


def test_the_registry_gives_dflash_a_its_static_engine():
    assert get_engine("dflash_a", "static") is DFlashAStatic
    assert get_engine("dflash", "static") is DFlashAStatic  # the alias too


@pytest.mark.parametrize("arch,block", [("llama", 4), ("llama", None), ("gemma4", 4)])
def test_static_dflash_a_is_greedy_lossless_and_drafts_what_the_eager_engine_drafts(models, arch, block):
    model, tok = models[arch]
    static, eager = DFlashAStatic.build(model, _cfg(arch, block)), DFlashA.build(model, _cfg(arch, block))
    base = StaticBase.build(model, engine_cfg(name="base"))
    assert static.block == (block or static.drafter.config.block_size)  # the drafter's own block when unset
    accepted = 0
    for prompt in _prompts(tok):
        want = _run(base, prompt).tokens
        got, ref = _run(static, prompt), _run(eager, prompt)
        assert got.tokens == want == ref.tokens, (arch, prompt)
        # the same drafts every round: the same acceptance, round for round
        assert [r.accepted for r in got.rounds] == [r.accepted for r in ref.rounds]
        accepted += sum(r.accepted for r in got.rounds)
    assert accepted > 0  # rounds that kept drafts, so a position moved by more than one was exercised


def test_the_static_drafter_cache_equals_the_eager_drafter_cache_up_to_its_position(models):
    model, tok = models["llama"]
    static, eager = DFlashAStatic.build(model, _cfg("llama")), DFlashA.build(model, _cfg("llama"))
    prompt = _prompts(tok, 1)[0]
    got, ref = _run(static, prompt, 40), _run(eager, prompt, 40)
    assert got.tokens == ref.tokens and sum(r.accepted for r in got.rounds) > 0
    pos, offset = static.dstate.position.item(), eager.dcache[0].offset
    # eager: the context up to the last read round; static: one more (the round queued behind it)
    assert len(prompt) + 30 < offset <= pos
    for s, e in zip(static.dstate.caches, eager.dcache):
        assert same_cache_values(s.arrays["k"][..., :offset, :], e.keys[..., :offset, :])
        assert same_cache_values(s.arrays["v"][..., :offset, :], e.values[..., :offset, :])


def test_the_static_drafter_forward_equals_the_eager_one_with_windows_causal_blocks_and_any_kept_count(models,
                                                                                                      tmp_path):
    # A drafter with a sliding-window layer (causal inside the block) and a full one (not): each round
    # both forwards see the same hidden rows, the static one all K + 1 with `kept` real, the eager one
    # only those; the logits and, at the end, the caches up to the position agree.
    model, _ = models["llama"]
    spec = {**DFLASH["llama"], "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}
    mx.random.seed(3)
    save_drafter(DFlashDrafter(DFlashConfig.from_json(spec, "spec")), tmp_path / "d", dtype=mx.float32)
    cfg = engine_cfg(name="dflash_a", block_size=4, drafter=str(tmp_path / "d"))
    static, eager = DFlashAStatic.build(model, cfg), DFlashA.build(model, cfg)
    assert [layer.self_attn.window for layer in static.drafter.layers] == [6, None]
    static.sampler = eager.sampler = Sampler(0.0, 0)
    prompt = list(range(5, 25))
    static.start(prompt, 64)
    eager.prefill(prompt)
    eager.prepare(prompt + [0])
    rng, kept, hidden = random.Random(0), 0, static.context  # the first round: no real row yet
    for _ in range(25):
        block = mx.array([rng.randrange(1000)] + [static.drafter.config.mask_token_id] * 3, dtype=mx.int32)
        got = static._draft(block, hidden, mx.array(kept, dtype=mx.int32))  # [K, V]
        ctx = eager.drafter.project_context(hidden[:, :kept])
        h = eager.drafter(embed(model, block[None]), ctx, eager.dcache)[:, 1:]
        want = eager.drafter.logits(lm_head(model, h, softcap=False))[0]
        assert mx.allclose(got, want, atol=1e-4), kept
        hidden, kept = mx.random.normal(hidden.shape), rng.randint(1, 4)
    pos = static.dstate.position.item()
    assert pos == eager.dcache[0].offset > len(prompt) + 6 * 10  # well past the window
    for s, e in zip(static.dstate.caches, eager.dcache):
        assert mx.allclose(s.arrays["k"][..., :pos, :], e.keys[..., :pos, :], atol=1e-5)
        assert mx.allclose(s.arrays["v"][..., :pos, :], e.values[..., :pos, :], atol=1e-5)


def test_one_host_read_per_round_and_one_trace_per_shape_never_one_per_step(models):
    model, tok = models["llama"]
    engine = DFlashAStatic.build(model, _cfg("llama"))
    short, long = _prompts(tok, 2)
    acc = _run(engine, short, 8).acceptance()
    assert acc["host_reads"] == acc["rounds"] == acc["read_ahead"] > 0
    traces = (engine.target.traces, engine.drafter_traces)
    assert traces == (1, 1)  # the target's verify of K + 1; the drafter's forward over [context; block]
    assert len(short) + 60 + 4 * engine.block < 512 and len(long) + 60 + 4 * engine.block < 512  # one bucket
    _run(engine, short, 60)
    _run(engine, long, 40)  # another prompt length, the same capacity bucket: no new trace
    assert (engine.target.traces, engine.drafter_traces) == traces
    assert engine.describe()["drafter_traces"] == 1


def test_sampled_static_dflash_a_equals_the_eager_engine_sample_for_sample(models):
    # Speculative sampling through verify_and_accept(drafts, q): the same q, the same keyed draws.
    model, tok = models["llama"]
    static, eager = DFlashAStatic.build(model, _cfg("llama")), DFlashA.build(model, _cfg("llama"))
    accepted = 0
    for seed, prompt in enumerate(_prompts(tok, 2)):
        sampler = Sampler(1.0, seed)
        got, ref = _run(static, prompt, sampler=sampler), _run(eager, prompt, sampler=sampler)
        assert got.tokens == ref.tokens
        accepted += sum(r.accepted for r in got.rounds)
    assert accepted > 0


def test_a_round_compiled_whole_gives_the_rounds_of_the_plain_one(models):
    model, tok = models["llama"]
    plain, fused = DFlashAStatic.build(model, _cfg("llama")), DFlashAStatic.build(model, _cfg("llama"))
    fused.fuse = True
    assert fused.describe()["fused_rounds"]
    for prompt in _prompts(tok, 2):
        a, b = _run(plain, prompt), _run(fused, prompt)
        assert a.tokens == b.tokens and [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]
