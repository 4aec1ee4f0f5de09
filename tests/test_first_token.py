"""Time to first token holds the drafter's work over the prompt, not round 1.

After the loop's Prefill event (the first token), a drafter's caches already cover every
prompt position: DFlash's context K/V, EAGLE-3's commit pass and MTP's first pass ran inside
the first token's time, and the profile splits that time into prefill and prepare.
"""

import pytest

from engines.base import Prefill
from engines.methods.dflash import DFlashA
from engines.methods.eagle3 import Eagle3
from engines.methods.mtp import MTP
from engines.runtime.sampling import Sampler
from harness.generation import run_generation
from harness.loop import generate
from harness.models import fixtures
from harness.prompts import encode_turn
from tests.conftest import builtin_prompts
from tests.helpers import base_tokens
from tests.test_dflash import dflash_cfg
from tests.test_eagle3 import eagle_cfg
from tests.test_mtp import mtp_cfg


def _engines(models):
    llama, qwen = models["llama"][0], models["qwen35"][0]
    return {
        "dflash_a": (llama, lambda: DFlashA.build(llama, dflash_cfg("llama", 4)), lambda e: e.dcache[0].offset),
        "eagle3": (llama, lambda: Eagle3.build(llama, eagle_cfg("llama")), lambda e: e.dcache[0].offset),
        "mtp": (qwen, lambda: MTP.build(qwen, mtp_cfg(fixtures.fixture_dir("qwen35"), 2)), lambda e: e.cache.offset),
    }


@pytest.mark.parametrize("method", ["dflash_a", "eagle3", "mtp"])
def test_the_drafter_covers_the_prompt_before_round_one_and_output_stays_lossless(models, method):
    model, make, drafter_offset = _engines(models)[method]
    tok = models["llama"][1]
    ids = encode_turn(tok, builtin_prompts()[0], 0, [], True)
    eng = make()
    events = generate(eng, ids, 12, Sampler(0.0, 0), profile=True)
    first = next(events)
    assert isinstance(first, Prefill)
    # the drafter has seen every prompt position (token t+1 paired with position t: len(ids) entries)
    assert drafter_offset(eng) == len(ids)
    assert set(first.phases) == {"prefill", "prepare"} and first.phases["prepare"] > 0
    assert first.seconds == pytest.approx(sum(first.phases.values()), rel=0.05)
    out = [first.token] + [t for ev in events for t in ev.emitted]
    assert out == base_tokens(model, ids, 12)  # still lossless


def test_the_record_splits_time_to_first_token(models):
    model, make, _ = _engines(models)["dflash_a"]
    tok = models["llama"][1]
    ids = encode_turn(tok, builtin_prompts()[0], 0, [], True)
    gen = run_generation(make(), ids, 8, Sampler(0.0, 0), profile=True)
    assert gen.first_phases["prepare"] > 0 and gen.prefill_s >= gen.first_phases["prefill"]
    assert gen.e2e_tps == pytest.approx(len(gen.tokens) / (gen.prefill_s + gen.decode_s))
