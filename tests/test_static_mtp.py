"""execution=static for MTP (engines/methods/mtp.py MTPStatic) on a dense target: greedy-lossless in float32
on the llama fixture, drafting what the eager MTP drafts round for round, the head's static cache
equal to the eager head's cache up to its position, one host read per round, one compiled trace per
shape, sampling equal to the eager engine's sample for sample, and Unsupported where it cannot run.

No fixture ships a dense MTP head: `llama_mtp_head` writes one for the llama fixture, made of the
target's own weights (its layer 2 as the head's layer, its final norm, fc passing the embedding of
token t+1 and half the target's state at t), so that it keeps a draft now and then (tau ~1.16 on the
built-in prompts) and the paths where the accepted count moves the head's position run. Lossless
output does not depend on the head's weights."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engines.drafters.mtp import MTPHead
from engines.errors import Unsupported
from engines.methods.device import StaticBase
from engines.methods.mtp import MTP, MTPStatic
from engines.registry import get_engine
from engines.runtime.sampling import Sampler
from harness.generation import run_generation
from harness.models.fixtures import fixture_dir
from tests.conftest import engine_cfg
from tests.test_lossless import _units

N = 32  # new tokens per generation
UNITS = ("explainer-1/0", "math-2/0", "explainer-3/0")  # built-in prompts where the head keeps drafts


@functools.lru_cache(maxsize=None)
def llama_mtp_head() -> Path:
    """A dense MTP head for the llama fixture, as `python -m train train=mtp` lays one out (module
    docstring says what it is made of); written once per session to a temp dir."""
    import mlx_lm

    model, _ = mlx_lm.load(str(fixture_dir("llama")))
    h = model.args.hidden_size
    weights = dict(tree_flatten(MTPHead(model).parameters()))
    fc = mx.zeros((h, 2 * h))
    fc[:, :h] = mx.eye(h)  # x = norm(embed(token t+1)) + 0.5 norm(target state at t)
    fc[:, h:] = 0.5 * mx.eye(h)
    weights["fc.weight"] = fc
    weights.update({f"layers.0.{k}": v for k, v in tree_flatten(model.model.layers[2].parameters())})
    weights["norm.weight"] = model.model.norm.weight
    dest = Path(tempfile.mkdtemp(prefix="static-mtp-head-"))
    atexit.register(shutil.rmtree, dest, True)
    mx.save_safetensors(str(dest / "model.safetensors"), {f"mtp.{k}": v.astype(mx.float32) for k, v in weights.items()},
                        metadata={"format": "mlx"})
    (dest / "config.json").write_text(json.dumps({"architectures": ["MTPHead"], "mtp_layout": "qwen3_next",
                                                  "target_model_type": "llama", "hidden_size": h}))
    return dest


def _cfg(block_size: int = 4):
    return engine_cfg(name="mtp", block_size=block_size, drafter=str(llama_mtp_head()))


def _prompts(tok, n: int = 3) -> list[list[int]]:
    ids = dict(_units(tok))
    return [ids[u] for u in UNITS[:n]]


def _run(engine, prompt, n=N, sampler=None):
    return run_generation(engine, prompt, n, sampler or Sampler(0.0, 0))


def test_the_registry_gives_mtp_its_static_engine():
    assert get_engine("mtp", "static") is MTPStatic


@pytest.mark.parametrize("block", [2, 4])
def test_static_mtp_is_greedy_lossless_and_drafts_what_the_eager_engine_drafts(models, block):
    model, tok = models["llama"]
    static, eager = MTPStatic.build(model, _cfg(block)), MTP.build(model, _cfg(block))
    base, eager_base = StaticBase.build(model, engine_cfg(name="base")), get_engine("base").build(model, _cfg())
    assert static.block == block
    accepted = 0
    for prompt in _prompts(tok):
        want = _run(base, prompt).tokens
        got, ref = _run(static, prompt), _run(eager, prompt)
        assert got.tokens == want == ref.tokens == _run(eager_base, prompt).tokens, prompt
        # the same drafts every round: the same acceptance, round for round
        assert [r.accepted for r in got.rounds] == [r.accepted for r in ref.rounds]
        accepted += sum(r.accepted for r in got.rounds)
    assert accepted > 0  # rounds that kept drafts, so the head's position moved by more than one


def test_the_static_head_cache_equals_the_eager_head_cache_up_to_its_position(models):
    model, tok = models["llama"]
    static, eager = MTPStatic.build(model, _cfg()), MTP.build(model, _cfg())
    prompt = _prompts(tok, 1)[0]
    got, ref = _run(static, prompt, 40), _run(eager, prompt, 40)
    assert got.tokens == ref.tokens and sum(r.accepted for r in got.rounds) > 0
    pos, offset = static.mstate.position.item(), eager.cache.offset
    # eager: the first passes up to the last draft; static: one more (the round queued behind it)
    assert len(prompt) + 30 < offset <= pos
    s, e = static.mstate.caches[0], eager.cache
    # the prompt's pass is split differently (P - 1 rows, then a round of K + 1): a rounding apart at most
    assert mx.allclose(s.arrays["k"][..., :offset, :], e.keys[..., :offset, :], atol=1e-5)
    assert mx.allclose(s.arrays["v"][..., :offset, :], e.values[..., :offset, :], atol=1e-5)


@pytest.mark.parametrize("block,drafter_traces", [(4, 2), (2, 1)])
def test_one_host_read_per_round_and_one_trace_per_shape_never_one_per_step(models, block, drafter_traces):
    model, tok = models["llama"]
    engine = MTPStatic.build(model, _cfg(block))
    short, long = _prompts(tok, 2)
    acc = _run(engine, short, 8).acceptance()
    assert acc["host_reads"] == acc["rounds"] == acc["read_ahead"] > 0
    traces = (engine.target.traces, engine.drafter_traces)
    assert traces == (1, drafter_traces)  # the verify of K + 1; the first pass of K + 1 and (K > 1) the chain step
    _run(engine, short, 60)
    _run(engine, long, 40)  # another prompt length, the same capacity bucket: no new trace
    assert (engine.target.traces, engine.drafter_traces) == traces
    assert engine.describe()["drafter_traces"] == drafter_traces


def test_sampled_static_mtp_equals_the_eager_engine_sample_for_sample(models):
    # Speculative sampling through verify_and_accept(drafts, q): the same q, the same keyed draws.
    model, tok = models["llama"]
    static, eager = MTPStatic.build(model, _cfg()), MTP.build(model, _cfg())
    accepted = 0
    for seed, prompt in enumerate(_prompts(tok, 2)):
        sampler = Sampler(1.0, seed)
        got, ref = _run(static, prompt, sampler=sampler), _run(eager, prompt, sampler=sampler)
        assert got.tokens == ref.tokens
        accepted += sum(r.accepted for r in got.rounds)
    assert accepted > 0


def test_a_one_token_prompt_needs_no_prompt_pass(models):
    model, _ = models["llama"]
    base = StaticBase.build(model, engine_cfg(name="base"))
    assert _run(MTPStatic.build(model, _cfg()), [7], 12).tokens == _run(base, [7], 12).tokens


def test_targets_without_a_static_mtp_form_are_unsupported(models):
    with pytest.raises(Unsupported, match="ArraysCache"):  # Qwen3.5: DeltaNet layers have no static cache
        MTPStatic.build(models["qwen35"][0], engine_cfg(name="mtp", block_size=2, drafter=str(fixture_dir("qwen35"))))
    with pytest.raises(Unsupported, match="dense full-attention"):  # gemma4: no MTP head is built for it
        MTPStatic.build(models["gemma4"][0], _cfg())
    with pytest.raises(Unsupported, match="block_size >= 2"):
        MTPStatic.build(models["llama"][0], _cfg(1))


def test_a_round_compiled_whole_gives_the_rounds_of_the_plain_one(models):
    model, tok = models["llama"]
    plain, fused = MTPStatic.build(model, _cfg()), MTPStatic.build(model, _cfg())
    fused.fuse = True
    assert fused.describe()["fused_rounds"]
    for prompt in _prompts(tok, 2):
        a, b = _run(plain, prompt), _run(fused, prompt)
        assert a.tokens == b.tokens and [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]
