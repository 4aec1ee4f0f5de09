"""Method options (Engine.options, method.options.<name>): a method's own settings declared by its engine,
so a new method adds one without touching the shared schema. Checked by name and type before anything
runs, part of the cell's id only where set away from the default, read by the engine as self.opt."""

import dataclasses
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from engines.registry import available, get_engine
from harness.config import MethodConfig, canonical_cell, check_options, register_configs, validate
from harness.errors import ConfigError
from tests.conftest import REPO, engine_cfg


def _compose(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_no_method_option_shadows_a_shared_setting_and_each_default_is_a_plain_value():
    fields = {f.name for f in dataclasses.fields(MethodConfig)}
    declared = {name: get_engine(name).options for name in available()}
    assert declared["suffix"] == {"workload": True}
    for name, options in declared.items():
        assert not set(options) & fields, f"{name}'s options shadow MethodConfig fields"
        assert all(isinstance(v, (bool, int, float, str)) for v in options.values()), name


def test_options_are_checked_by_name_and_type_and_an_option_of_another_method_is_ignored():
    suffix = get_engine("suffix")
    check_options(engine_cfg(name="suffix", options={"workload": False}), suffix)
    with pytest.raises(ConfigError, match=r"method.options.workload=3 is not valid for suffix: it takes a bool "
                                          r"\(default true\)"):
        check_options(engine_cfg(name="suffix", options={"workload": 3}), suffix)
    with pytest.raises(ConfigError, match=r"method.options.wrkload: no method has such an option; suffix takes "
                                          r"workload \(every method's: suffix: workload\)"):
        check_options(engine_cfg(name="suffix", options={"wrkload": False}), suffix)
    check_options(engine_cfg(name="ngram", options={"workload": False}), get_engine("ngram"))  # a sweep crosses them

    class Knobbed:  # the other default types: ints take no bool, floats take ints but no nan
        options = {"n": 2, "p": 0.5, "mode": "a"}

    for bad, why in (({"n": True}, "takes a int"), ({"n": 1.5}, "takes a int"), ({"p": "x"}, "takes a float"),
                     ({"p": float("nan")}, "not a finite number"), ({"mode": 1}, "takes a str")):
        with pytest.raises(ConfigError, match=why):
            check_options(engine_cfg(name="k", options=bad), Knobbed)
    check_options(engine_cfg(name="k", options={"n": 3, "p": 1, "mode": "b"}), Knobbed)


def test_an_option_is_in_the_cell_only_off_its_default_and_the_engine_reads_it():
    default, same, off = (_compose("arch=llama", "method=suffix", *o) for o in
                          ((), ("method.options.workload=true",), ("method.options.workload=false",)))
    for cfg in (default, same, off):
        validate(cfg)
    assert "options" not in canonical_cell(default)["method"] and canonical_cell(same) == canonical_cell(default)
    assert canonical_cell(off)["method"]["options"] == {"workload": False}
    crossed = _compose("arch=llama", "method=ngram", "++method.options.workload=false")
    validate(crossed)
    assert canonical_cell(crossed) == canonical_cell(_compose("arch=llama", "method=ngram"))  # ngram ignores it
    suffix = get_engine("suffix")
    assert suffix.option_values(off.method) == {"workload": False}
    assert suffix.option_values(engine_cfg(name="suffix")) == {"workload": True}


def test_an_option_a_method_file_does_not_list_is_refused_in_one_line_with_the_way_to_add_it(tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness", "arch=llama", "method=ngram", "method.options.x=1",
                        f"out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "++method.options.<name>=<value>" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "harness", "arch=llama", "method=suffix", "++method.options.x=1",
                        f"out_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "method.options.x: no method has such an option" in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())
