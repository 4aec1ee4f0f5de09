"""Warm-ups compile what the timed runs will use, so a timed rep never pays a first-time plan.

On GPUs every prompt gets a short warm-up (its prefill shapes); a prompt whose timed runs reach
a key bucket no warm-up has reached gets a full one (a new bucket means new attention plans: on
the H100 at 0706631 the one gate prompt that crossed 256 keys ran its first timed rep at a
quarter of its speed in both arms, and the gate flagged it as an outlier).
"""

import pytest

from engines.methods.autoregressive import Autoregressive
from engines.runtime.target import Target
from harness import measure
from harness.config import BenchConfig
from harness.measure import Arms, key_bucket, measure_cell
from tests.conftest import builtin_prompts, engine_cfg

NEW = 6
BENCH = BenchConfig(temperature=0.0, seed=0, stop_at_eos=False, truncate_prompts=False, max_new_tokens=NEW, warmup=1,
                    warmup_scope="every", warmup_tokens=2, reps=1, cooldown_s=0.0, profile=False, chat_template=True)


def _warm_ups(models, monkeypatch, bucket: int) -> list[tuple[int, int]]:
    """(prompt tokens, tokens generated) of every prompt's warm-up, in order."""
    model, tok = models["llama"]
    calls = []
    real = measure.run_generation

    def record(engine, ids, max_new_tokens, *args, **kw):
        calls.append((len(ids), max_new_tokens))
        return real(engine, ids, max_new_tokens, *args, **kw)

    monkeypatch.setattr(measure, "run_generation", record)
    monkeypatch.setattr(measure, "KEY_BUCKET", bucket)
    arms = Arms(Autoregressive(Target(model), engine_cfg(name="base")),
                Autoregressive(Target(model), engine_cfg(name="base")), 1)
    measure_cell(arms, tok, builtin_prompts()[:4], BENCH)
    # per prompt: the warm-up's two generations (method, base), then one timed pair
    assert len(calls) == 4 * 4
    return [calls[4 * p] for p in range(4)]


def test_a_prompt_reaching_a_new_key_bucket_warms_up_in_full(models, monkeypatch):
    warm = _warm_ups(models, monkeypatch, bucket=1)  # every longer context is a new bucket
    reached = 0
    for p, (n_ids, generated) in enumerate(warm):
        reach = n_ids + NEW + 1
        full = p == 0 or reach > reached
        assert generated == (NEW if full else 2), (p, n_ids, reached)
        reached = max(reached, reach if full else n_ids + 2 + 1)
    assert any(g == 2 for _, g in warm[1:]), "the prompts never exercised the short warm-up"
    assert any(g == NEW for _, g in warm[1:]), "the prompts never exercised a full later warm-up"


def test_within_the_warmed_bucket_later_prompts_warm_up_short(models, monkeypatch):
    warm = _warm_ups(models, monkeypatch, bucket=10_000)
    assert [g for _, g in warm] == [NEW, 2, 2, 2]


@pytest.mark.parametrize("keys, bucket", [(0, 0), (1, 1), (256, 1), (257, 2), (512, 2)])
def test_key_buckets_are_mlx_lm_cache_steps(keys, bucket):
    assert measure.KEY_BUCKET == 256 and key_bucket(keys) == bucket
