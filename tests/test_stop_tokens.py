"""Stop tokens: a generation ends at the first stop token and includes it, whether a pipelined
engine emits it one step at a time or a drafting round emits it mid-round; with
bench.stop_at_eos the record's outputs end there too, and without it they run to the budget."""

from dataclasses import replace

import pytest

import harness.measure as measure
from engines.methods.dflash import DFlashA
from engines.methods.eagle3 import Eagle3
from engines.runtime.sampling import Sampler
from harness.generation import run_generation
from harness.measure import Arms, measure_cell
from harness.models import fixtures
from harness.prompts import encode_turn
from tests.conftest import builtin_prompts, engine_cfg
from tests.helpers import base_engine
from tests.test_divergence import BENCH
from tests.test_lossless import _units

N = 32


def _dflash(model):
    drafter = str(fixtures.drafter_dir("dflash", "llama"))
    return DFlashA.build(model, engine_cfg(block_size=None, drafter=drafter))


def _eagle3(model):  # greedy: a draft tree, the path the target accepts emitted as one round
    return Eagle3.build(model, engine_cfg(drafter=str(fixtures.drafter_dir("eagle3", "llama")),
                                                 verify="batched", depth=3, top_k=2, total_tokens=6))


def _run(engine, ids, stops=frozenset()):
    return run_generation(engine, ids, N, Sampler(0.0), stop_tokens=frozenset(stops))


def _mid_round_stop(gen) -> int | None:
    """An output index inside a round's emission, not its last, whose token first occurs there."""
    start = 1  # the prefill emitted index 0
    for r in gen.rounds:
        for j in range(start, start + len(r.emitted) - 1):
            if gen.tokens[j] not in gen.tokens[:j]:
                return j
        start += len(r.emitted)
    return None


def _first_run_with(make, model, prompts, pick):
    """(prompt, output, index) for the first prompt whose output has an index `pick` accepts."""
    for prompt, ids in prompts:
        full = _run(make(model), ids)
        j = pick(full)
        if j is not None:
            return prompt, full, j
    pytest.fail("no prompt gave an output with a usable stop position")


def _late_first(gen) -> int | None:
    return next((j for j in range(N // 2, N) if gen.tokens[j] not in gen.tokens[:j]), None)


def test_a_pipelined_generation_stops_at_and_includes_the_first_stop_token(models):
    model, tok = models["llama"]
    ids, full, j = _first_run_with(base_engine, model, ((ids, ids) for _, ids in _units(tok)), _late_first)
    got = _run(base_engine(model), ids, {full.tokens[j], 999_999})
    assert got.tokens == full.tokens[: j + 1] and len(got.rounds) == j
    assert _run(base_engine(model), ids, {full.tokens[0]}).tokens == full.tokens[:1]  # the prefill's token stops it


@pytest.mark.parametrize("make", [_dflash, _eagle3], ids=["dflash_a", "eagle3"])
def test_a_round_that_emits_a_stop_token_mid_round_is_cut_right_after_it(models, make):
    model, tok = models["llama"]
    ids, full, j = _first_run_with(make, model, ((ids, ids) for _, ids in _units(tok)), _mid_round_stop)
    got = _run(make(model), ids, {full.tokens[j]})
    assert got.tokens == full.tokens[: j + 1]
    last = got.rounds[-1]  # the round that emitted it, cut short
    assert last.emitted[-1] == full.tokens[j] and len(last.emitted) < len(full.rounds[len(got.rounds) - 1].emitted)


class _StopsAt:
    """The fixture tokenizer with `eos_token_ids` replaced (a fixture's own EOS may never be emitted)."""

    def __init__(self, tokenizer, ids):
        self._tokenizer, self.eos_token_ids = tokenizer, set(ids)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_stop_at_eos_ends_both_arms_outputs_in_the_record_at_the_eos_and_only_with_it(models, monkeypatch):
    # the calibration at a 4x longer context takes seconds here and decides nothing about the outputs
    monkeypatch.setattr(measure, "context_scaling", lambda *a, **kw: None)
    model, tok = models["llama"]
    single = ((p, encode_turn(tok, p, 0, [], BENCH.chat_template)) for p in builtin_prompts() if len(p.turns) == 1)
    prompt, full, j = _first_run_with(_dflash, model, single, _mid_round_stop)
    for stop_at_eos, n in ((True, j + 1), (False, N)):
        bench = replace(BENCH, max_new_tokens=N, reps=1, stop_at_eos=stop_at_eos)
        method = _dflash(model)
        arms = Arms(method, base_engine(model), method.block)
        out = measure_cell(arms, _StopsAt(tok, {full.tokens[j]}), [prompt], bench)
        (item,) = out["prompts"]
        assert item["tokens"] == full.tokens[:n] and item["n_tokens"] == n, stop_at_eos
        assert item["n_tokens_reps"] == [n] and item["base"]["n_tokens_reps"] == [n]  # the base arm too
        assert item["first_divergence"] is None and out["summary"]["diverged_prompts"] == 0
