"""Arms alternate within each prompt, so an order-dependent cost cannot bias the ratio.

Two identical arms (base decoding against base decoding) should measure 1.0x. A planted
delay charged to whichever arm runs first in a pair (a cold cache, a grown allocator) is
invisible to a fixed order's reader but biases its ratio; alternation cancels it in the
geometric mean. The tests replace each generation's measured decode time by a synthetic
one (0.1 s, plus the delay when first) so the check is exact, not at the mercy of noise.
"""


import pytest

from engines.methods.autoregressive import Autoregressive
from engines.runtime.target import Target
from harness import measure
from harness.config import BenchConfig
from harness.measure import Arms, measure_cell
from tests.conftest import builtin_prompts, engine_cfg

BENCH = BenchConfig(temperature=0.0, seed=0, stop_at_eos=False, truncate_prompts=False, max_new_tokens=6, warmup=0,
                        warmup_scope="first", reps=4, cooldown_s=0.0, profile=False, chat_template=True)
DELAY_S, DECODE_S = 0.5, 0.1


def _cell(models, monkeypatch):
    model, tok = models["llama"]
    runs = []
    real = measure.run_generation

    def planted(engine, *args, **kw):
        gen = real(engine, *args, **kw)
        first_of_pair = len(runs) % 2 == 0  # warm-up 0, no profile, block 1: every run is one of a timed pair
        gen.decode_s = DECODE_S + (DELAY_S if first_of_pair else 0.0)
        runs.append(engine)
        return gen

    monkeypatch.setattr(measure, "run_generation", planted)
    arms = Arms(Autoregressive(Target(model), engine_cfg(name="base")), Autoregressive(Target(model), engine_cfg(name="base")), 1)
    out = measure_cell(arms, tok, builtin_prompts()[:3], BENCH)
    return out, runs, arms


def test_the_arm_order_alternates_and_is_recorded(models, monkeypatch):
    out, runs, arms = _cell(models, monkeypatch)
    orders = [i["arm_order"] for i in out["prompts"]]
    assert orders[0] == ["mb", "bm", "mb", "bm"] and orders[1] == ["bm", "mb", "bm", "mb"]
    assert orders[2] == orders[0]
    # the order recorded is the order that ran
    ran = ["mb" if runs[2 * j] is arms.method else "bm" for j in range(len(runs) // 2)]
    assert ran == [o for order in orders for o in order]


def test_a_planted_first_arm_delay_does_not_bias_the_ratio(models, monkeypatch):
    out, _, _ = _cell(models, monkeypatch)
    s = out["summary"]
    assert s["speedup"] == pytest.approx(1.0, rel=1e-9)
    assert s["speedup_prompts"] == pytest.approx(1.0, rel=1e-9)
    assert s["speedup_ci_low"] <= s["speedup"] <= s["speedup_ci_high"]


def test_a_fixed_order_is_biased_by_the_same_delay(models, monkeypatch):
    # What the alternation guards against: with the method always first, it alone pays the delay.
    monkeypatch.setattr(measure, "method_first", lambda unit, rep: True)
    out, _, _ = _cell(models, monkeypatch)
    assert out["summary"]["speedup"] == pytest.approx(DECODE_S / (DECODE_S + DELAY_S), rel=0.05)


def test_no_garbage_collection_lands_inside_a_timed_rep(models, monkeypatch):
    # Each timed run makes cyclic garbage enough to cross the collector's thresholds many times;
    # with the collector paused around the reps, none of those collections runs inside a rep.
    import gc
    model, tok = models["llama"]
    inside, during = [], []
    real = measure.run_generation

    def churning(engine, *args, **kw):
        inside.append(True)
        for _ in range(20_000):
            a = []
            a.append(a)
        gen = real(engine, *args, **kw)
        inside.pop()
        return gen

    def watch(phase, info):
        if phase == "start" and inside:
            during.append(info["generation"])

    monkeypatch.setattr(measure, "run_generation", churning)
    gc.callbacks.append(watch)
    try:
        arms = Arms(Autoregressive(Target(model), engine_cfg(name="base")), None, 1)
        measure_cell(arms, tok, builtin_prompts()[:2], BENCH)
    finally:
        gc.callbacks.remove(watch)
    assert gc.isenabled()
    assert during == []
