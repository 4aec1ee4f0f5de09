"""execution=static (engines/runtime/static.py, engines/methods/device.py): caches whose position is a device
value, rounds that stay on the device and are read one round late. Lossless against eager base,
the same cache contents as the eager path up to the position, one host read per round, one
compiled trace per shape, never a token past the budget or a stop token."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engines.errors import Unsupported
from engines.methods.ngram import NgramIndex, lookup
from engines.registry import STATIC, get_engine
from engines.runtime.sampling import Sampler
from engines.runtime.static import StaticTarget, static_layout
from engines.runtime.target import Target
from harness.generation import run_generation
from harness.models.fixtures import drafter_dir, fixture_dir
from tests.conftest import engine_cfg
from tests.helpers import same_cache_values

PROMPTS = [list(range(5, 25)), [7, 8, 9, 7, 8, 9, 7, 8, 9, 100, 7, 8], [3] * 40]


DRAFTER_KIND = {"eagle3": "eagle3", "dflash_a": "dflash", "dflash_c": "dflash"}  # fixture drafters by method


def _cfg(name: str, arch: str = "llama", **extra):
    """A method config for `arch`'s fixture: its own drafter, a block of 4 (EAGLE-3: a depth-3 chain)."""
    if name == "draft_model":
        extra.setdefault("drafter", str(fixture_dir("llama")))
    if name in DRAFTER_KIND:
        extra.setdefault("drafter", str(drafter_dir(DRAFTER_KIND[name], arch)))
    if name == "mtp":
        if arch != "llama":
            pytest.skip(f"MTP static runs on dense targets: no MTP head for {arch}")
        from tests.test_static_mtp import llama_mtp_head

        extra.setdefault("drafter", str(llama_mtp_head()))
    if name == "eagle3":
        extra.update(depth=3, top_k=1, total_tokens=3)
    elif name != "base":
        extra.setdefault("block_size", 4)
    return engine_cfg(name=name, **extra)


def _run(engine, prompt, n=40, sampler=None, stop=frozenset()):
    return run_generation(engine, prompt, n, sampler or Sampler(0.0, 0), stop_tokens=stop)


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
@pytest.mark.parametrize("method", sorted(STATIC))
def test_every_static_method_is_greedy_lossless_in_float32(models, arch, method):
    model, _ = models[arch]
    base = get_engine("base").build(model, _cfg("base"))
    static_base = get_engine("base", "static").build(model, _cfg("base"))
    engine = get_engine(method, "static").build(model, _cfg(method, arch))
    for prompt in PROMPTS:
        ref = _run(static_base, prompt).tokens
        assert _run(engine, prompt).tokens == ref, (arch, method, prompt)
        if arch == "llama":  # the static cache attends over the same keys as the eager one, in the same order
            assert ref == _run(base, prompt).tokens


def test_a_target_without_a_static_form_is_unsupported_with_the_reason(models):
    model, _ = models["qwen35"]
    assert "ArraysCache" in static_layout(model)
    with pytest.raises(Unsupported, match="execution=static: layer 0 keeps a ArraysCache"):
        get_engine("base", "static").build(model, _cfg("base"))
    assert "quantized KV cache" in static_layout(models["llama"][0], "q8")


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_a_static_cache_after_any_accept_pattern_equals_the_eager_cache_up_to_its_position(models, arch):
    model, _ = models[arch]
    static, eager = StaticTarget(model, static_layout(model)), Target(model)
    prompt = list(range(3, 30))
    static.prefill(prompt, 600)
    eager.prefill(prompt)
    rng = random.Random(0)
    for _ in range(40):  # verify 1..6 tokens, keep a random prefix (most of a sliding window's 32 passes)
        tokens = [rng.randrange(200) for _ in range(rng.randint(1, 6))]
        keep = rng.randint(1, len(tokens))
        static.verify(tokens)
        eager.verify(tokens)
        static.commit(keep)
        eager.commit(keep)
    pos = static.position.item()
    assert pos == eager.offset
    probe = [11, 12, 13]  # the caches answer the same: the same keys up to the position, nothing past it
    assert mx.allclose(static.verify(probe).logits, eager.verify(probe).logits, atol=1e-5)
    full = [(c, e) for c, e in zip(static.cache, eager.cache) if type(e).__name__ == "KVCache"]
    assert full  # (a sliding window's rotating buffer holds another layout: the probe above checks those)
    # llama: bit for bit (on the CPU). gemma4's sliding layers attend over a masked buffer instead of a rotated
    # one, so the layers after them see inputs a rounding apart (~1e-5)
    same = same_cache_values if arch == "llama" else (lambda a, b: mx.allclose(a, b, atol=1e-4))
    for c, e in full:
        assert same(c.arrays["k"][..., :pos, :], e.keys[..., :pos, :])
        assert same(c.arrays["v"][..., :pos, :], e.values[..., :pos, :])


def test_one_host_read_per_round_each_queued_behind_the_next_round(models):
    model, _ = models["llama"]
    for method in sorted(STATIC):
        gen = _run(get_engine(method, "static").build(model, _cfg(method)), PROMPTS[1])
        acc = gen.acceptance()
        assert acc["host_reads"] == acc["rounds"] == acc["read_ahead"] > 0, method


def test_a_compiled_phase_traces_once_per_shape_never_once_per_step(models):
    model, _ = models["llama"]
    engine = get_engine("draft_model", "static").build(model, _cfg("draft_model"))
    _run(engine, PROMPTS[0], n=8)
    traces = (engine.target.traces, engine.dm.traces)
    assert traces == (1, 2)  # the target's verify of K + 1; the draft model's steps of 2 and of 1
    _run(engine, PROMPTS[0], n=60)
    _run(engine, PROMPTS[2], n=30)  # another prompt length, the same capacity bucket
    assert (engine.target.traces, engine.dm.traces) == traces


@pytest.mark.parametrize("method", sorted(STATIC))
def test_the_late_read_never_emits_past_the_budget_or_a_stop_token(models, method):
    model, _ = models["llama"]
    engine = get_engine(method, "static").build(model, _cfg(method))
    full = _run(engine, PROMPTS[0], n=30).tokens
    for n in (2, 3, 5, 7, 11):
        assert _run(engine, PROMPTS[0], n=n).tokens == full[:n]
    stop = full[9]
    cut = _run(engine, PROMPTS[0], n=30, stop=frozenset({stop})).tokens
    assert cut == full[: full.index(stop) + 1]


def test_sampled_static_base_and_ngram_equal_eager_base_sample_for_sample(models):
    # Gumbel noise keyed by a device position is the noise keyed by the host's: same samples.
    model, _ = models["llama"]
    sampler = Sampler(1.0, 7)
    ref = _run(get_engine("base").build(model, _cfg("base")), PROMPTS[1], sampler=sampler).tokens
    for method in ("base", "ngram"):
        assert _run(get_engine(method, "static").build(model, _cfg(method)), PROMPTS[1], sampler=sampler).tokens == ref


def test_a_device_position_gives_the_host_positions_random_key():
    for seed, stream, pos in ((0, 0, 0), (3, 2, 7), (255, 3, 2**19), (2**31, 1, 5)):
        s = Sampler(1.0, seed)
        assert s.key(pos, stream).tolist() == s.key(mx.array(pos, dtype=mx.int32), stream).tolist()


def test_the_device_ngram_lookup_drafts_what_the_index_drafts():
    rng = random.Random(1)
    for _ in range(200):
        hist = [rng.randint(0, 4) for _ in range(rng.randint(1, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 2)
        hi = rng.randint(lo, 4)
        want = NgramIndex(lo, hi).propose(hist, k) or [hist[-1]] * k  # no match: the last token, K times
        buf = mx.array(hist + [0] * 9, dtype=mx.int32)
        assert lookup(buf, mx.array(len(hist), dtype=mx.int32), k, lo, hi).tolist() == want, (hist, k, lo, hi)


def test_static_and_eager_caches_of_one_model_are_independent(models):
    model, _ = models["llama"]
    eager_cache = make_prompt_cache(model)  # a static target never touches the model's own cache objects
    t = StaticTarget(model, static_layout(model))
    t.prefill([1, 2, 3], 8)
    assert all(c.offset == 0 for c in eager_cache)


@pytest.mark.parametrize("method", [m for m in sorted(STATIC) if get_engine(m, "static").fusable])
def test_a_round_compiled_whole_gives_the_rounds_of_the_plain_one(models, method):
    model, _ = models["llama"]
    plain = get_engine(method, "static").build(model, _cfg(method))
    fused = get_engine(method, "static").build(model, _cfg(method))
    fused.fuse = True
    assert fused.fusable and fused.describe()["fused_rounds"]
    for prompt in PROMPTS[:2]:
        a, b = _run(plain, prompt, n=24), _run(fused, prompt, n=24)
        assert a.tokens == b.tokens and [r.accepted for r in a.rounds] == [r.accepted for r in b.rounds]
    traces = fused.target.traces
    _run(fused, PROMPTS[2], n=24)
    assert fused.target.traces == traces  # the whole round traced once, like its parts


def test_a_fused_round_follows_the_sampler_and_counts_what_it_feeds(models):
    # temperature and seed are constants of a traced round: a new sampler gets its own compiled round
    model, _ = models["llama"]
    plain = get_engine("draft_model", "static").build(model, _cfg("draft_model"))
    fused = get_engine("draft_model", "static").build(model, _cfg("draft_model"))
    fused.fuse = True
    for sampler in (Sampler(0.0, 0), Sampler(1.0, 3), Sampler(1.0, 4), Sampler(0.0, 0)):
        fed = fused.target.fed_tokens
        a, b = _run(plain, PROMPTS[0], 16, sampler), _run(fused, PROMPTS[0], 16, sampler)
        assert a.tokens == b.tokens, sampler.temperature
        assert fused.target.fed_tokens - fed == len(PROMPTS[0]) + sum(r.drafted + 1 for r in b.rounds) + 4


def test_static_ngram_verifies_drafts_only_where_the_latest_read_matched(models):
    """A static n-gram round verifies its K drafts, or none (a one-token step) where the latest outcome
    read says the lookup found no match, as eager n-gram drafting does; the record's `drafted` says which
    ran, and the target is fed exactly that (plus the round queued behind the last read)."""
    model, _ = models["llama"]
    engine = get_engine("ngram", "static").build(model, _cfg("ngram"))
    widths = set()
    for prompt in PROMPTS:
        fed = engine.target.fed_tokens
        gen = _run(engine, prompt, n=30)
        drafted = [r.drafted for r in gen.rounds]
        widths |= set(drafted)
        extra = engine.target.fed_tokens - fed - len(prompt) - sum(d + 1 for d in drafted)
        assert extra in (1, 4), extra  # the one round queued past the last read: narrow or wide
    assert widths == {0, 3}  # both kinds ran over these prompts
    # the first rounds' width is the eager index's answer over prompt + first token; after a read, the
    # read's match flag (its last entry)
    cfg = _cfg("ngram")
    for prompt in [*PROMPTS, [1, 2, 3, 4, 5, 6]]:
        first = engine.start(prompt, 30).item()
        matched = bool(NgramIndex(cfg.min_ngram, cfg.max_ngram).propose([*prompt, first], 3))
        assert engine.round_reach() == (3 if matched else 0), prompt
        head = engine.next_round()
        engine.next_round()
        values = head.tolist()
        assert engine.read(values) == (3 if matched else 0)
        assert engine.round_reach() == (3 if values[-1] else 0)
