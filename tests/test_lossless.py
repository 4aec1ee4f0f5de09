"""Losslessness in float32: every method's greedy output equals base greedy output."""

import pytest

from engines.methods.ngram import Ngram
from engines.runtime.cache import ROLLBACK_STRATEGIES
from engines.runtime.target import Target
from harness.prompts import encode_turn
from tests.conftest import ARCHS, builtin_prompts, method_cfg
from tests.helpers import Oracle, base_engine, base_tokens, generate_ids

NEW_TOKENS = 48  # > the gemma fixtures' window of 32, on top of prompts that already exceed it


def _units(tokenizer):
    """Token ids of every turn of every built-in prompt (later turns answered with a fixed text)."""
    for p in builtin_prompts():
        for turn in range(len(p.turns)):
            yield f"{p.id}/{turn}", encode_turn(tokenizer, p, turn, ["A short earlier answer."] * turn, True)


@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_greedy_output_is_identical_to_base_on_every_builtin_prompt(models, arch):
    model, tok = models[arch]
    base, ngram = base_engine(model), Ngram(Target(model), method_cfg(block_size=4))
    rejected_rounds = 0
    for uid, ids in _units(tok):
        want = generate_ids(base, ids, NEW_TOKENS)
        got = generate_ids(ngram, ids, NEW_TOKENS)
        assert got.tokens == want.tokens, f"{arch} {uid}: diverged at " \
            f"{next(i for i, (a, b) in enumerate(zip(got.tokens, want.tokens)) if a != b)}"
        rejected_rounds += sum(r.accepted < r.drafted for r in got.rounds)
    assert rejected_rounds >= 50, f"only {rejected_rounds} rounds rolled back: the test would prove little"


@pytest.mark.parametrize("strategy", list(ROLLBACK_STRATEGIES))
@pytest.mark.parametrize("arch", ["qwen35", "gemma4"])
def test_partial_acceptance_at_every_position_stays_lossless(models, arch, strategy):
    # An oracle with one corrupted token per round: acceptance lengths 0..K all occur,
    # so rollbacks keep every possible prefix of the block on the hybrid and past the window.
    model, tok = models[arch]
    k = 4
    seen = set()
    for _, ids in list(_units(tok))[::4]:
        want = base_tokens(model, ids, NEW_TOKENS)
        eng = Oracle(Target(model, rollback=strategy), k, want, len(ids), corrupt=True, seed=len(ids))
        got = generate_ids(eng, ids, NEW_TOKENS)
        assert got.tokens == want
        seen |= {r.accepted for r in got.rounds if r.drafted == k}
    assert seen == set(range(k + 1)), f"acceptance lengths seen: {sorted(seen)}"


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_drafter_gets_every_draft_accepted(models, arch):
    model, tok = models[arch]
    ids = next(_units(tok))[1]
    want = base_tokens(model, ids, NEW_TOKENS)
    k = 3
    got = generate_ids(Oracle(Target(model), k, want, len(ids)), ids, NEW_TOKENS)
    assert got.tokens == want
    full = [r for r in got.rounds[:-1] if r.drafted == k]  # the last round's output is cut at the budget
    assert len(full) >= (NEW_TOKENS - 1) // (k + 1) - 1
    assert all(len(r.emitted) == k + 1 for r in full), "tau must be K+1 on every full round"
    assert got.acceptance()["tau"] > k


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_sampled_ngram_output_equals_base_sampling_with_the_same_seed(models, arch):
    # Deterministic drafts are accepted iff they equal the target's sample at that
    # position, so with per-position noise keys the outputs must coincide.
    model, tok = models[arch]
    ngram = Ngram(Target(model), method_cfg(block_size=4))
    differs_from_greedy = 0
    for _, ids in list(_units(tok))[:6]:
        want = generate_ids(base_engine(model), ids, NEW_TOKENS, temperature=1.0, seed=11).tokens
        got = generate_ids(ngram, ids, NEW_TOKENS, temperature=1.0, seed=11).tokens
        assert got == want
        differs_from_greedy += got != base_tokens(model, ids, NEW_TOKENS)
    assert differs_from_greedy >= 3, "sampling had too little effect for the test to mean anything"
