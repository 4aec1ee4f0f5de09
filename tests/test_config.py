import pytest
from hydra import compose, initialize_config_dir

from harness.__main__ import check_overrides, parse_overrides
from harness.config import canonical_cell, conf_dir, register_configs, validate
from harness.errors import ConfigError
from harness.records import cell_id


def cfg(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_base_ignores_block_size_and_rollback_so_those_cells_coincide():
    a = cfg("method=base", "method.block_size=3", "rollback=capture")
    b = cfg("method=base", "method.block_size=5", "rollback=replay")
    assert cell_id(canonical_cell(a)) == cell_id(canonical_cell(b))


def test_axes_a_method_uses_give_distinct_cells():
    ids = {cell_id(canonical_cell(cfg("method=ngram", f"method.block_size={bs}", f"kv={kv}")))
           for bs in (3, 5) for kv in ("native", "q8")}
    assert len(ids) == 4
    assert cell_id(canonical_cell(cfg("method=ngram", "rollback=replay"))) != \
        cell_id(canonical_cell(cfg("method=ngram", "rollback=capture")))


def test_defaults_are_valid_and_name_the_fixture():
    c = cfg()
    validate(c)
    assert c.arch.model == "fixture:qwen35" and c.method.name == "base" and c.kv.name == "native"


@pytest.mark.parametrize("overrides, message", [
    (["method=ngram", "method.block_size=1"], "integer >= 2"),
    (["method=ngram", "method.min_ngram=3", "method.max_ngram=2"], "min_ngram <= max_ngram"),
    (["arch.dtype=float8"], "use one of: float32"),
    (["bench.reps=0"], "bench.reps=0"),
    (["bench.temperature=-1"], "temperature"),
])
def test_invalid_values_are_rejected_with_the_valid_ones(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg(*overrides))


@pytest.mark.parametrize("args, message", [
    (["method=nope"], "available: base, control, control_b8, ddtree, dflash_a, dflash_c, dflash_zlab, draft_model, eagle3, "
                      "mlx_lm, mlx_lm_spec, mtp, ngram, ngram_b8, server, subprocess, suffix"),
    (["method=base,nope"], "unknown method 'nope'"),
    (["bench.reps_typo=2"], "bench has: suite"),
    (["+sweep=nope"], "available: cost-curves, cost-curves-qwen-shape, cost-curves-scale, gemma4, llama, qwen35, qwen_coder, smollm2, smollm2-axes, smollm2-static, smollm2_full"),
])
def test_unknown_options_and_keys_are_caught_before_hydra_runs(args, message):
    with pytest.raises(ConfigError, match=message):
        check_overrides(parse_overrides(args))
    check_overrides(parse_overrides(["method=ngram", "method.block_size=5", "+sweep=qwen35", "hydra.verbose=true"]))


@pytest.mark.parametrize("method", ["base", "ngram", "draft_model", "mlx_lm_spec"])
def test_the_qwen_coder_sweep_drafts_the_1_5b_with_the_0_5b(method):
    c = cfg("+sweep=qwen_coder", f"method={method}", "method.block_size=5")
    validate(c)
    assert (c.arch.model, c.method.drafter, c.bench.suite) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b",
                                                               "mtbench+humaneval+gsm8k")
