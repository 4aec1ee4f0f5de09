"""A prompt prefix fed once and restored (engines/runtime/prefix.py): the same logits every time, close
to feeding the whole prompt, on every cache kind; and every method stays lossless with it."""

import json

import mlx.core as mx
import numpy as np
import pytest

from engines.runtime.prefix import PrefixCache, PrefixStore
from engines.runtime.target import Target
from tests.conftest import ARCHS
from tests.helpers import base_engine, generate_ids
from tests.test_cli import QUICK, harness
from tests.test_context import write_conversations


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=n).tolist()


@pytest.mark.parametrize("arch", ARCHS)  # attention, DeltaNet state, sliding windows (a prefix past the window of 32)
def test_a_restored_prefix_gives_the_logits_of_its_first_feeding_bit_for_bit(models, arch):
    model, _ = models[arch]
    prefix = _prompt(100, 0)
    target = Target(model, hidden_layers=(1,))
    target.prefix = PrefixCache(prefix)
    runs = []
    for tail_seed in (1, 1, 2):
        logits, hidden = target.prefill(prefix + _prompt(7, tail_seed))
        mx.eval(logits, hidden)
        runs.append((np.array(logits), np.array(hidden), target.offset))
    assert (target.prefix.fed, target.prefix.restored) == (1, 2)
    assert np.array_equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
    assert runs[0][1].shape[1] == 107 and runs[0][2] == 107  # hidden and offset cover the whole prompt
    want, want_hidden = Target(model, hidden_layers=(1,)).prefill(prefix + _prompt(7, 2))
    np.testing.assert_allclose(runs[2][0], np.array(want), atol=1e-4)
    np.testing.assert_allclose(runs[2][1], np.array(want_hidden), atol=1e-4)


def test_a_prompt_without_the_prefix_is_prefilled_whole(models):
    model, _ = models["llama"]
    target = Target(model)
    target.prefix = PrefixCache(_prompt(50, 0))
    target.prefill(_prompt(60, 3))
    target.prefill(_prompt(50, 0))  # the prefix alone: nothing left to feed after it
    assert (target.prefix.fed, target.prefix.restored) == (0, 0)
    assert PrefixStore().get([1, 2]) is not PrefixStore().get([1, 2])
    store = PrefixStore()
    first = store.get([1, 2])
    assert store.get([1, 2]) is first and store.get([1, 3]) is not first


@pytest.mark.parametrize("arch", ["qwen35", "gemma4"])
def test_decoding_after_a_restored_prefix_rolls_back_exactly(models, arch):
    # The base arm and an oracle drafter, both restoring the prefix: rollbacks on the restored
    # DeltaNet state and past the sliding window still give base's output.
    from tests.helpers import Oracle

    model, _ = models[arch]
    prefix, ids = _prompt(80, 0), None
    ids = prefix + _prompt(10, 5)
    pc = PrefixCache(prefix)
    base = base_engine(model)
    base.use_prefix(pc)
    want = generate_ids(base, ids, 40).tokens
    eng = Oracle(Target(model), 3, want, len(ids), corrupt=True, seed=1)
    eng.use_prefix(pc)
    assert generate_ids(eng, ids, 40).tokens == want
    assert (pc.fed, pc.restored) == (1, 1)  # base fed it, the oracle restored it


def test_every_drafting_method_with_a_context_stays_lossless_and_restores_its_prefix(tmp_path):
    src = write_conversations(tmp_path / "c.jsonl", 10)
    out = tmp_path / "out"
    common = [*QUICK, "bench.max_prompts=2", "bench.context=300", f"bench.context_source={src}", f"out_dir={out}"]
    r = harness("-m", "arch=llama", "method=dflash_a,eagle3,draft_model,ngram", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = harness("arch=qwen35", "method=mtp", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(p.read_text()) for p in out.glob("*.json")]
    assert sorted(rec["cell"]["method"]["name"] for rec in recs) == ["dflash_a", "draft_model", "eagle3", "mtp", "ngram"]
    for rec in recs:
        assert rec["status"] == "ok" and rec["summary"]["diverged_prompts"] == 0, rec["cell_id"]
        reuse = rec["context"]["prefix_reuse"]
        assert reuse["restored"] > 0 and reuse["tokens"] > 300, (rec["cell_id"], reuse)
        assert rec["calibration"]["context_scaling"].get("skipped")


def test_eagle3s_pass_over_a_restored_prefix_is_made_once_and_restored_after(models):
    # issue 51: with bench.context, the drafter's pass over the context was redone every generation
    from engines.methods.eagle3 import Eagle3
    from engines.runtime.sampling import Sampler
    from harness.generation import run_generation
    from harness.models.fixtures import drafter_dir
    from tests.conftest import engine_cfg

    model, _ = models["llama"]
    cfg = engine_cfg(name="eagle3", drafter=str(drafter_dir("eagle3", "llama")), depth=3, top_k=2, total_tokens=6)
    prefix = _prompt(100, 0)
    engine = Eagle3.build(model, cfg)
    engine.use_prefix(PrefixCache(prefix))
    base = base_engine(model)
    sampler = Sampler(0.0, 0)
    for tail in (1, 2, 1):
        prompt = prefix + _prompt(7, tail)
        assert run_generation(engine, prompt, 16, sampler).tokens == generate_ids(base, prompt, 16).tokens
    p = engine.target.prefix
    assert (p.drafter_fed, p.drafter_restored) == (1, 2)
    again = Eagle3.build(model, cfg)  # the state the first pass left equals the state restored
    again.use_prefix(PrefixCache(prefix))
    again.prefill(prefix + _prompt(7, 1))
    again.prepare(prefix + _prompt(7, 1) + [0])
    engine.prefill(prefix + _prompt(7, 1))
    engine.prepare(prefix + _prompt(7, 1) + [0])
    for a, b in zip(engine.dcache, again.dcache):
        assert a.offset == b.offset == 107 and mx.array_equal(a.state[0], b.state[0])


def test_mtps_pass_over_a_restored_prefix_is_made_once_and_restored_after(models):
    from engines.methods.mtp import MTP
    from engines.runtime.sampling import Sampler
    from harness.generation import run_generation
    from tests.conftest import engine_cfg
    from tests.test_static_mtp import llama_mtp_head

    model, _ = models["llama"]
    engine = MTP.build(model, engine_cfg(name="mtp", block_size=3, drafter=str(llama_mtp_head())))
    prefix = _prompt(100, 0)
    engine.use_prefix(PrefixCache(prefix))
    base = base_engine(model)
    for tail in (1, 2, 1):
        prompt = prefix + _prompt(7, tail)
        assert run_generation(engine, prompt, 16, Sampler(0.0, 0)).tokens == generate_ids(base, prompt, 16).tokens
    p = engine.target.prefix
    assert (p.drafter_fed, p.drafter_restored) == (1, 2)
