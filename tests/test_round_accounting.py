"""A round cut by the token budget or a stop token keeps its true accepted count.

Histograms and per-position acceptance count what the target accepted; how many of those
tokens the budget let out is a separate number (the emitted tokens)."""

from engines.runtime.sampling import Sampler
from engines.runtime.target import Target
from harness.generation import round_table, run_generation
from tests.helpers import Oracle, base_engine, generate_ids
from tests.test_lossless import _units

K = 3


def _oracle_run(models, budget, stop=frozenset(), unit=0, profile=False):
    model, tok = models["llama"]
    ids = list(_units(tok))[unit][1]
    want = generate_ids(base_engine(model), ids, budget + 2 * K).tokens  # drafts run past the budget
    gen = run_generation(Oracle(Target(model), K, want, len(ids)), ids, budget, Sampler(0.0, 0), profile=profile,
                         stop_tokens=stop)
    return gen, want


def test_the_budget_cuts_emitted_tokens_not_the_accepted_count(models):
    budget = 1 + 2 * (K + 1) + 2  # two full rounds, then a round of K accepted drafts cut to 2 tokens
    gen, want = _oracle_run(models, budget)
    assert gen.tokens == want[:budget]
    last = gen.rounds[-1]
    assert (last.drafted, last.accepted, len(last.emitted)) == (K, K, 2)
    assert gen.acceptance()["accept_hist"] == [0, 0, 0, 3]  # every round accepted all K drafts
    assert gen.acceptance()["accepted_at"] == [3, 3, 3]
    table = round_table(gen)
    assert table["accepted"] == [K] * 3 and table["emitted"] == [K + 1, K + 1, 2]


def test_a_stop_token_cuts_emitted_tokens_not_the_accepted_count(models):
    budget = 1 + 4 * (K + 1)
    for unit in range(8):  # a prompt whose output has a token first seen inside a round, not at its end
        _, want = _oracle_run(models, budget, unit=unit)
        j = next((j for j in range(1, budget) if (j - 1) % (K + 1) < K and want[j] not in want[:j]), None)
        if j is not None:
            break
    gen, _ = _oracle_run(models, budget, frozenset({want[j]}), unit)
    assert gen.tokens == want[: j + 1]
    last = gen.rounds[-1]
    assert (last.accepted, len(last.emitted)) == (K, (j - 1) % (K + 1) + 1)
