"""Forced acceptance (engines/runtime/forced.py, method.force): every round does its real work, the count it
accepts is the setting's, and what it leaves in the caches is what its emitted tokens would leave.

A fixed count is followed exactly by every drafting method, eagerly and on the device; a rate gives
accepted counts distributed as the setting says (seeded chi-square); the target cache after every
round equals the cache of feeding the emitted tokens one by one; a forced record never passes a
losslessness bound; bad settings are refused in one line.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from engines.registry import STATIC, get_engine
from engines.runtime.forced import Force, accept_forced
from engines.runtime.sampling import Sampler
from engines.runtime.target import Target
from engines.runtime.tree import accept_tree_on_device
from harness.loop import Round, generate
from tests.test_static import PROMPTS, _cfg

EAGER = ["ngram", "draft_model", "eagle3", "eagle3_tree", "dflash_a", "dflash_c", "mtp"]


def _engine(model, name: str, execution: str = "eager", **force):
    extra = {"depth": 3, "top_k": 2, "total_tokens": 6} if name == "eagle3_tree" else {}
    cfg = _cfg(name.removesuffix("_tree"), **extra)
    cfg.force.accepted, cfg.force.rate = force.get("accepted"), force.get("rate")
    return get_engine(name.removesuffix("_tree"), execution).build(model, cfg)


def _rounds(engine, prompt, n=40) -> list[Round]:
    return [e for e in generate(engine, prompt, n, Sampler(0.0, 0)) if isinstance(e, Round)]


@pytest.mark.parametrize("accepted", [0, 2, 9])
@pytest.mark.parametrize("name", EAGER)
def test_a_fixed_count_is_accepted_every_round(models, name, accepted):
    model, _ = models["llama"]
    rounds = _rounds(_engine(model, name, accepted=accepted), PROMPTS[0])
    assert rounds
    for r in rounds[:-1]:  # the last may be cut by the budget
        assert r.accepted == min(accepted, r.drafted), (name, r)
        assert len(r.emitted) == r.accepted + 1


@pytest.mark.parametrize("name", sorted(set(STATIC) - {"base"}))
def test_a_fixed_count_is_accepted_every_round_on_the_device(models, name):
    model, _ = models["llama"]
    names = [name, "eagle3_tree"] if name == "eagle3" else [name]
    for n in names:
        rounds = _rounds(_engine(model, n, "static", accepted=2), PROMPTS[1])
        assert len(rounds) > 3
        assert all(r.accepted == 2 and len(r.emitted) == 3 for r in rounds[:-1]), (n, rounds)


def test_both_executions_emit_the_same_tokens_under_the_same_force(models):
    # (methods whose drafts are the same in both: n-gram's eager lookup may draft fewer than K)
    model, _ = models["llama"]
    for name in ("draft_model", "eagle3", "dflash_a"):
        eager = [t for r in _rounds(_engine(model, name, accepted=2), PROMPTS[0]) for t in r.emitted]
        static = [t for r in _rounds(_engine(model, name, "static", accepted=2), PROMPTS[0]) for t in r.emitted]
        assert eager == static, name


def test_a_rate_gives_the_truncated_geometric_counts(models):
    # Each position is kept with probability p given the one before: P(n = j) = p^j (1 - p) for j < K,
    # p^K for j = K. Counts over many rounds, chi-square at 1% with K degrees of freedom.
    p, k, n = 0.6, 4, 1200
    force = Force(rate=p, seed=3)
    counts = [0] * (k + 1)
    for pos in range(n):
        counts[int(force.count(k, pos).item())] += 1
    expected = [n * p ** j * (1 - p) for j in range(k)] + [n * p ** k]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(counts, expected))
    assert chi2 < 13.28, (counts, expected)  # chi-square, 4 dof, 1%
    again = [int(force.count(k, pos).item()) for pos in range(50)]
    assert again == [int(Force(rate=p, seed=3).count(k, pos).item()) for pos in range(50)]  # seeded by position
    assert again != [int(Force(rate=p, seed=4).count(k, pos).item()) for pos in range(50)]
    device = int(force.count(k, mx.array(17, dtype=mx.int32)).item())
    assert device == int(force.count(k, 17).item())  # the device key equals the host one


def test_a_rate_cell_accepts_in_distribution(models):
    model, _ = models["llama"]
    rounds = [r for r in _rounds(_engine(model, "draft_model", rate=0.5), PROMPTS[2], 120)
              if r.drafted == 3]  # (the budget's last rounds draft fewer)
    assert len(rounds) > 40
    mean = sum(r.accepted for r in rounds) / len(rounds)
    want = sum(0.5 ** j for j in range(1, 4))  # E[n] for K = 3, p = 0.5: 0.875
    assert abs(mean - want) < 4 * math.sqrt(0.9 / len(rounds)), (mean, want, len(rounds))


@pytest.mark.parametrize("name", ["ngram", "eagle3_tree", "dflash_a", "mtp"])
def test_the_cache_after_every_round_is_the_cache_of_its_emitted_tokens(models, name):
    model, _ = models["llama"]
    engine = _engine(model, name, accepted=2)
    prompt, out = PROMPTS[0], []
    for e in generate(engine, prompt, 30, Sampler(0.0, 0)):
        out += e.emitted if isinstance(e, Round) else [e.token]
        if not isinstance(e, Round) or len(e.emitted) < e.accepted + 1:  # (the budget cut the last round)
            continue
        fed = prompt + out[:-1]  # the last emitted token is pending: not in the cache yet
        ref = Target(model)
        ref.prefill(prompt)
        for t in out[:-1]:
            ref.verify(mx.array([t], dtype=mx.int32))
        for c, r in zip(engine.target.cache, ref.cache):
            assert c.offset == r.offset == len(fed)
            assert mx.allclose(c.keys[..., :len(fed), :], r.keys[..., :len(fed), :], atol=1e-4).item(), name


def test_accept_forced_emits_the_drafts_then_the_targets_token():
    out = accept_forced(mx.array([5, 6, 7]), mx.array([1, 2, 3, 4]), mx.array([2], dtype=mx.int32)).tolist()
    assert out == [2, 5, 6, 3, 3]
    out = accept_forced(mx.array([5, 6, 7]), mx.array([1, 2, 3, 4]), mx.array([0], dtype=mx.int32)).tolist()
    assert out == [0, 1, 1, 1, 1]
    # a tree [root] + 4 nodes: 1, 2 children of the root, 3 of node 1, 4 of node 3; forced 2: down 1, 3
    tokens, parents, choices = mx.array([10, 11, 12, 13]), mx.array([0, 0, 1, 3]), mx.array([20, 21, 22, 23, 24])
    outcome, path = accept_tree_on_device(tokens, parents, choices, 3, mx.array([2], dtype=mx.int32))
    assert outcome.tolist() == [2, 10, 12, 23, 23] and path.tolist()[:3] == [0, 1, 3]
    assert Force(accepted=2).path([-1, -1, 0, 2], 0) == [0, 2]


def test_a_forced_record_never_passes_a_losslessness_bound():
    from types import SimpleNamespace

    from harness.gate import evaluate

    check = SimpleNamespace(name="lossless", min={"speedup": 0.5}, max={"diverged_prompts": 0})
    record = {"status": "ok", "summary": {"speedup": 1.2, "diverged_prompts": 0}, "forced": {"accepted": 2}}
    rows = evaluate(check, record)
    assert [r[-1] for r in rows] == ["FAIL"] and "forced" in rows[0][3]
    del record["forced"]
    assert all(r[-1] == "pass" for r in evaluate(check, record))
    speed_only = SimpleNamespace(name="speed", min={"speedup": 0.5}, max={})
    assert all(r[-1] == "pass" for r in evaluate(speed_only, {**record, "forced": {"accepted": 2}}))


@pytest.mark.parametrize("overrides,message", [
    (["method=base", "method.force.accepted=2"], "method.force applies to drafting methods"),
    (["method=ngram", "method.force.accepted=2", "method.force.rate=0.5"], "both set"),
    (["method=ngram", "method.force.rate=1.5"], "method.force.rate=1.5 is above the bound 1"),
    (["method=ngram", "method.force.accepted=-1"], "method.force.accepted=-1 is not valid"),
    (["method=mlx_lm", "method.force.rate=0.5"], "runs its own loop"),
])
def test_bad_force_settings_are_refused_in_one_line(overrides, message):
    from harness.config import validate
    from harness.errors import ConfigError
    from tests.test_config import cfg

    with pytest.raises(ConfigError, match=message):
        validate(cfg("arch=llama", *overrides))


def test_forced_cells_have_their_own_ids_and_report_a_cost_curve(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.test_cli import QUICK, harness, records

    r = harness("-m", "arch=llama", "method=draft_model", "method.force.accepted=1,3", *QUICK, f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    recs = sorted(records(tmp_path).values(), key=lambda rec: rec["forced"]["accepted"])
    assert [rec["forced"] for rec in recs] == [{"accepted": 1}, {"accepted": 3}]
    assert "__forced-n1__" in recs[0]["cell_id"] and recs[1]["cell"]["method"]["force"] == {"accepted": 3}
    for rec in recs:
        for item in rec["prompts"]:  # rounds by accepted count: the setting's every round but the budget's last
            n = rec["forced"]["accepted"]
            assert item["accept_hist"][n] >= item["rounds"] - 1 and sum(item["accept_hist"]) == item["rounds"]
    assert recs[0]["summary"]["tau"] < recs[1]["summary"]["tau"]
    rep = subprocess.run([sys.executable, "-m", "report", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr
    md = (tmp_path / "report.md").read_text()
    assert "draft_model [forced 1 a round]" in md and "/2 (forced" in md
    section = md.split("### Cost at a chosen acceptance")[1]
    assert "| draft_model |" in section and "Median |measured - predicted| / measured over 2 forced cells" in section
    assert (tmp_path / "speedup_vs_forced_tau.png").stat().st_size > 5000


def test_every_drafting_method_runs_forced_on_a_scale_preset_with_drafters_of_its_shape(tmp_path):
    from tests.test_cli import QUICK, harness, records

    r = harness("-m", "arch=llama", "arch.model=scale:llama-tiny", "method=eagle3,dflash_a,draft_model,mtp",
                "method.force.accepted=2", "method.block_size=4", *QUICK, f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    recs = {rec["cell"]["method"]["name"]: rec for rec in records(tmp_path).values()}
    assert sorted(recs) == ["dflash_a", "draft_model", "eagle3", "mtp"]
    for name, rec in recs.items():
        assert rec["status"] == "ok" and rec["forced"] == {"accepted": 2}, name
        for item in rec["prompts"]:  # two drafts kept every round but the budget's last
            assert item["accept_hist"][2] >= item["rounds"] - 1, name
    assert recs["draft_model"]["engine"]["drafter_layers"] == 2  # llama-tiny-draft's, not the target's 4
