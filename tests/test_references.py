"""Reference implementations as arms: mlx-lm's generate_step and z-lab's DFlash, same tokens as ours."""

import builtins
import json

import mlx.core as mx
import pytest

from engines.arms.external import DFlashZlab, MlxLm
from engines.errors import Unsupported
from engines.methods.autoregressive import Autoregressive
from engines.runtime.cache import cache_nbytes
from engines.runtime.hidden import decoder
from engines.runtime.target import Target
from harness.generation import Generation, timings
from harness.models import fixtures
from report.frames import cells
from tests.conftest import ARCHS, engine_cfg
from tests.helpers import base_engine, generate_ids
from tests.test_cli import QUICK, harness, records
from tests.test_lossless import NEW_TOKENS, _units


def _mlx_lm(model, tok, **kw):
    eng = MlxLm(Target(model, **kw), engine_cfg(name="mlx_lm"))
    eng.tokenizer = tok
    return eng


def _zlab(model, tok, arch):
    cfg = engine_cfg(block_size=None, drafter=str(fixtures.drafter_dir("dflash", arch)))
    eng = DFlashZlab(Target(model), cfg)
    eng.tokenizer = tok
    return eng


@pytest.mark.parametrize("arch", ARCHS)
def test_base_output_equals_mlx_lm_generate_on_every_builtin_prompt(models, arch):
    model, tok = models[arch]
    base, ref = base_engine(model), _mlx_lm(model, tok)
    for uid, ids in _units(tok):
        assert generate_ids(base, ids, NEW_TOKENS).tokens == generate_ids(ref, ids, NEW_TOKENS).tokens, f"{arch} {uid}"


@pytest.mark.parametrize("arch", ARCHS)
def test_zlab_dflash_reference_output_equals_base_and_leaves_the_target_untouched(models, arch):
    pytest.importorskip("dflash.model_mlx", reason="z-lab's dflash is an optional extra: pip install -e '.[anchors]'")
    model, tok = models[arch]
    layers = list(decoder(model).layers)
    base, ref = base_engine(model), _zlab(model, tok, arch)
    drafted = accepted = 0
    for uid, ids in list(_units(tok))[:6]:
        got = generate_ids(ref, ids, NEW_TOKENS)
        assert got.tokens == generate_ids(base, ids, NEW_TOKENS).tokens, f"{arch} {uid}"
        drafted += sum(r.drafted for r in got.rounds)
        accepted += sum(r.accepted for r in got.rounds)
    assert drafted > 0 and accepted > 0  # it drafted, and the target accepted some (over the six prompts)
    assert list(decoder(model).layers) == layers and "_hidden_states" not in model  # its layer hooks are gone


def test_zlab_reference_without_the_package_is_unsupported_with_the_install_line(models, monkeypatch):
    real_import = builtins.__import__

    def no_dflash(name, *args, **kw):
        if name.startswith("dflash"):
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_dflash)
    with pytest.raises(Unsupported, match=r"pip install -e '\.\[anchors\]'"):
        _zlab(models["llama"][0], models["llama"][1], "llama")


def test_mlx_lm_arm_quantizes_its_kv_cache_like_the_cell_and_refuses_cast_storage(models):
    model, tok = models["llama"]
    ids = list(range(10, 60))
    native = generate_ids(_mlx_lm(model, tok), ids, 24)
    q8 = generate_ids(_mlx_lm(model, tok, kv="q8"), ids, 24)
    ours = generate_ids(Autoregressive(Target(model, kv="q8"), engine_cfg(name="base")), ids, 24)
    assert q8.cache_bytes < native.cache_bytes  # 8-bit K/V take less room than float32 ones
    assert q8.tokens == ours.tokens  # the same quantized cache, the same greedy output
    with pytest.raises(Unsupported, match="float16"):
        _mlx_lm(model, tok, kv="float16")


def test_cache_bytes_count_every_buffer(models):
    model, _ = models["qwen35"]
    t = Target(model)
    t.prefill(list(range(10, 50)))
    mx.eval([c.state for c in t.cache])
    arrays = [a for c in t.cache for part in ("keys", "values", "cache") for a in _arrays(getattr(c, part, None))]
    assert cache_nbytes(t.cache) == sum(a.nbytes for a in arrays) > 0


def _arrays(part):
    if isinstance(part, mx.array):
        return [part]
    return [a for x in (part or []) for a in _arrays(x)] if isinstance(part, (list, tuple)) else []


def test_a_rep_slower_than_a_third_of_its_median_is_flagged():
    gens = [Generation([0] * 11, 0.0, s, peak_bytes=10, cache_bytes=5) for s in (0.1, 0.11, 0.5, 0.1)]
    t = timings(gens)
    assert t["outlier_reps"] == [2] and t["peak_memory_bytes"] == 10 and t["cache_bytes"] == 5
    assert timings(gens[:2] + gens[3:])["outlier_reps"] == []


def test_base_paired_with_mlx_lm_writes_a_paired_record_with_memory(tmp_path):
    out = tmp_path / "out"
    r = harness("method=base", "reference=mlx_lm", "arch=llama", *QUICK, "bench.reps=2", f"out_dir={out}")
    assert r.returncode == 0, r.stderr
    (name, rec), = records(out).items()
    assert "__vs-mlx_lm" in name and rec["status"] == "ok"
    s = rec["summary"]
    assert s["speedup"] > 0 and s["speedup_ci_low"] is not None and len(s["speedup_reps"]) == 2
    assert s["diverged_prompts"] == 0  # base and mlx-lm agree token for token
    assert s["peak_memory_bytes"] > 0 and s["base_peak_memory_bytes"] > 0
    assert s["cache_bytes"] > 0 and s["base_cache_bytes"] > 0
    # outliers: the summary counts the reps each prompt flags in either arm, each a rep that ran
    flagged = [r for item in rec["prompts"] for r in item["outlier_reps"] + item["base"]["outlier_reps"]]
    assert s["outlier_reps"] == len(flagged) and set(flagged) <= {0, 1}
    # the method's own description (base trims its cache), not the reference's, which is named in the cell
    assert rec["engine"].get("rollback") == "trim" and "implementation" not in rec["engine"], rec["engine"]
    assert rec["cell"]["reference"] == "mlx_lm"
    # strict JSON (no NaN or Infinity, which other readers refuse), and the report reads the cell back as written
    assert json.loads((out / name).read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the record")) == rec
    row = cells(out).set_index("cell_id").loc[rec["cell_id"]]
    assert (row["method"], row["reference"], row["status"]) == ("base vs mlx_lm", "mlx_lm", "ok")
    assert row["speedup"] == s["speedup"] and row["diverged_prompts"] == 0 and row["prompts"] == s["prompts"]


def test_rollback_auto_measures_every_strategy_and_runs_the_fastest(tmp_path):
    out = tmp_path / "out"
    r = harness("method=dflash_a", "arch=qwen35", "method.block_size=4", *QUICK, "bench.max_prompts=1",
                f"out_dir={out}")
    assert r.returncode == 0, r.stderr
    (rec,) = records(out).values()
    costs = rec["calibration"]["rollback"]["verify_and_rollback_ms"]
    assert set(costs) == {"capture", "recompute", "replay"} and all(v > 0 for v in costs.values())
    assert rec["engine"]["rollback"] == rec["calibration"]["rollback"]["fastest"] == min(costs, key=costs.get)
    assert rec["cell"]["rollback"] == "auto" and rec["summary"]["diverged_prompts"] == 0
