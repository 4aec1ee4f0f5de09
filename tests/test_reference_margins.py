"""Divergence against an external reference is judged by that reference's own numbers.

Against `reference=mlx_lm` the margin at a first divergence comes from the log-probabilities
mlx-lm's generate_step yielded in that very run (a log-probability margin equals the logit
margin), never from the method's target under the reference's name."""

import mlx.core as mx
import pytest

from engines.arms.external import MlxLm
from engines.runtime.target import Target
from harness.divergence import divergence_margin
from harness.generation import Generation
from harness.measure import Arms, measure_cell
from harness.prompts import encode_turn
from tests.conftest import builtin_prompts, engine_cfg, method_cfg
from tests.test_divergence import BENCH, KeepsOneRejected


def _cell(models):
    model, tok = models["llama"]
    suite = [p for p in builtin_prompts() if p.category == "retrieval"]
    ref = MlxLm(Target(model), engine_cfg(name="mlx_lm"))
    ref.tokenizer = tok
    arms = Arms(KeepsOneRejected(Target(model), method_cfg(block_size=4)), ref, 4, reference_is_base=False)
    return measure_cell(arms, tok, suite, BENCH), suite, model, tok


def test_margins_come_from_mlx_lm_log_probabilities(models, monkeypatch):
    # mlx-lm's scores are marked (doubled) on their way out of generate_step: a margin taken from
    # them is twice the logit margin, one recomputed with a target is not.
    import importlib

    gen_module = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is also a function)
    real = gen_module.generate_step
    monkeypatch.setattr(gen_module, "generate_step",
                        lambda *a, **kw: ((tok, 2 * lp) for tok, lp in real(*a, **kw)))
    out, suite, model, tok = _cell(models)
    diverged = [i for i in out["prompts"] if i["first_divergence"] is not None]
    assert len(diverged) >= 2
    for item in diverged:
        at, d = item["first_divergence"], item["divergence"]
        assert d["margin_source"] == "mlx_lm log-probabilities"
        prompt = next(p for p in suite if p.id == item["id"])
        ids = encode_turn(tok, prompt, item["turn"], [], True)
        logits = model(mx.array([ids + item["tokens"][:at]]))[0, -1]  # [V], an independent forward
        top = sorted(logits.tolist(), reverse=True)
        assert d["reference_margin"] == pytest.approx(2 * (top[0] - top[1]), abs=1e-3)
        assert d["reference_top1"] == d["reference_token"]


def test_an_external_reference_without_scores_says_unavailable(models):
    model, tok = models["llama"]
    ref = MlxLm(Target(model), engine_cfg(name="mlx_lm"))
    gen = Generation([1, 2, 3], 0.0, 0.0)  # a reference run that kept no scores
    d = divergence_margin(ref, gen, [5, 6], [1, 2, 4], 2)
    assert d["margin_source"].startswith("unavailable") and "reference_margin" not in d
    assert (d["reference_token"], d["method_token"]) == (3, 4)

