"""Hostile input, round three (issue 50): a stale result never counts, a gate always measures,
environment faults are one line and an exit code (never a traceback with exit 1), every number
is checked before anything runs, and a sweep is validated whole before its first cell."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.config import Config, conf_dir, register_configs, validate
from harness.errors import ConfigError
from harness.identity import cell_inputs, code_fingerprint, stale
from tests.conftest import REPO, subprocess_env, write_jsonl
from tests.test_cli import harness

TINY = ["arch=llama", "method=base", "bench=smoke", "bench.max_prompts=1", "bench.max_new_tokens=4", "bench.warmup=0",
        "bench.reps=1", "bench.profile=false"]


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.strip().splitlines() if ln.startswith("error: ")]


def _one_line(r, code: int) -> str:
    """The run's one `error:` line, after checking its exit code and that no traceback came with it."""
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    (line,) = _errors(r.stderr)
    return line


def _record(out: Path) -> dict:
    (path,) = out.glob("*.json")
    return json.loads(path.read_text())


# --- 1. a stale record never counts -------------------------------------------------------------

def test_a_record_is_reused_only_for_the_same_suite_content_and_code(tmp_path):
    suite = write_jsonl(tmp_path / "suite.jsonl", [{"prompt": "Count from one to ten."}])
    args = [*TINY, f"bench.suite={suite}", f"out_dir={tmp_path / 'out'}"]
    assert harness(*args).returncode == 0
    first = _record(tmp_path / "out")
    assert first["inputs"]["suite"] == {str(suite): first["suite"][0]["sha256"]}
    assert first["inputs"]["code"] == code_fingerprint() and first["run"]["id"]

    again = harness(*args)
    assert again.returncode == 0 and "already recorded" in again.stderr
    assert _record(tmp_path / "out")["run"] == first["run"]

    write_jsonl(suite, [{"prompt": "Count from one to twenty."}])  # same id, same path, other content
    edited = harness(*args)
    assert edited.returncode == 0, edited.stderr
    assert "the prompt suite's content changed" in edited.stderr and "measuring it again" in edited.stderr
    remeasured = _record(tmp_path / "out")
    assert remeasured["run"] != first["run"] and remeasured["suite"][0]["sha256"] != first["suite"][0]["sha256"]


def test_a_record_made_by_other_code_is_measured_again_unless_reuse_other_code(tmp_path):
    args = [*TINY, f"out_dir={tmp_path}"]
    assert harness(*args).returncode == 0
    path = next(tmp_path.glob("*.json"))
    rec = json.loads(path.read_text())
    rec["inputs"]["code"]["source_sha256"] = "0" * 64  # as another commit would have written it
    path.write_text(json.dumps(rec))

    reused = harness(*args, "reuse_other_code=true")
    assert reused.returncode == 0 and "already recorded" in reused.stderr
    redone = harness(*args)
    assert redone.returncode == 0 and "measured by other code (source 000000000000" in redone.stderr
    assert json.loads(path.read_text())["run"] != rec["run"]


def test_stale_names_what_changed_and_passes_what_did_not():
    now = {"suite": {"builtin": "a" * 64}, "target": "b" * 64, "drafter:method": "c" * 64,
           "code": {"source_sha256": "d" * 64, "mlx": "1", "mlx_lm": "2"}}
    assert stale(now, now, False) is None
    assert "method arm's drafter weights changed (eeeeeeeeeeee -> cccccccccccc)" in stale({**now, "drafter:method": "e" * 64}, now, False)
    assert "the target's weights changed" in stale({**now, "target": "f" * 64}, now, True)  # content always counts
    older = {**now, "code": {**now["code"], "mlx": "0"}}
    assert "other code" in stale(older, now, False) and stale(older, now, True) is None
    assert "names none of its inputs" in stale(None, now, False) and stale(None, now, True) is None


def test_the_inputs_hash_every_file_a_record_reads(tmp_path):
    from harness.models.fixtures import drafter_dir, fixture_dir

    ctx = tmp_path / "ctx.jsonl"
    ctx.write_text("[]")
    inputs = cell_inputs([{"spec": "builtin", "sha256": "x"}], fixture_dir("llama"),
                         {"method": drafter_dir("dflash", "llama"), "reference": None}, ctx)
    assert set(inputs) == {"suite", "target", "drafter:method", "context_source", "code"}
    assert inputs["target"] != inputs["drafter:method"]
    ctx.write_text("[ ]")
    assert cell_inputs([], fixture_dir("llama"), {}, ctx)["context_source"] != inputs["context_source"]


# --- the gate always measures ---------------------------------------------------------------------

def _gate_dir(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "conf"
    (d / "gate").mkdir(parents=True)
    (d / "gate" / "tiny.yaml").write_text("# @package _global_\n" + body)
    return d


TINY_GATE = """gate:
  name: tiny
  checks:
    - name: base decoding runs and matches itself (llama)
      overrides: [arch=llama, method=base, bench=smoke, bench.max_prompts=1, bench.max_new_tokens=4, bench.warmup=0,
                  bench.reps=1, bench.profile=false]
      max: {diverged_prompts: 0}
"""


def test_a_gate_run_twice_into_one_out_dir_measures_twice(tmp_path):
    conf = _gate_dir(tmp_path, TINY_GATE)
    args = [f"hydra.searchpath=[file://{conf}]", "+gate=tiny", f"out_dir={tmp_path / 'out'}"]
    first = harness(*args)
    assert first.returncode == 0, first.stderr
    run1 = _record(tmp_path / "out")["run"]
    second = harness(*args)
    assert second.returncode == 0, second.stderr
    assert "already recorded" not in second.stderr and "all 1 bounds met" in second.stderr
    assert _record(tmp_path / "out")["run"] != run1


def test_a_gate_judges_only_records_its_own_run_made():
    from omegaconf import OmegaConf

    from harness.gate import evaluate

    check = OmegaConf.create({"name": "c", "min": {}, "max": {"diverged_prompts": 0}})
    record = {"status": "ok", "summary": {"diverged_prompts": 0}, "run": {"id": "old"}}
    assert [r[-1] for r in evaluate(check, record, "now")] == ["FAIL"]
    assert [r[-1] for r in evaluate(check, {**record, "run": {"id": "now"}}, "now")] == ["pass"]


@pytest.mark.parametrize("body, words", [
    ("gate:\n  name: tiny\n  checks: []\n", "gate tiny has no checks"),
    ("gate:\n  name: tiny\n  checks:\n    - overrides: [arch=llama]\n      max: {diverged_prompts: 0}\n",
     "check 1 has no `name`"),
    ("gate:\n  name: tiny\n  checks:\n    - name: c\n      overrides: [arch=llama]\n      min: {speedup: .nan}\n",
     "min.speedup=nan is not a finite number"),
    ("gate:\n  name: tiny\n  checks:\n    - name: c\n      overrides: [arch=llama, bench.reps=0]\n"
     "      max: {diverged_prompts: 0}\n", "gate tiny check 'c': bench.reps=0 is not valid"),
])
def test_a_gate_that_cannot_measure_is_refused_before_it_runs(tmp_path, body, words):
    conf = _gate_dir(tmp_path, body)
    r = harness(f"hydra.searchpath=[file://{conf}]", "+gate=tiny", f"out_dir={tmp_path / 'out'}")
    assert words in _one_line(r, 2)
    assert not (tmp_path / "out").exists()


def test_zero_run_jobs_are_refused():
    r = subprocess.run([sys.executable, "jobs/gate_noise.py", "--runs", "0", "--out", "/nonexistent/x"], cwd=REPO,
                       capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert "--runs=0" in _one_line(r, 2)
    r = subprocess.run(["bash", "jobs/cuda-suite.sh", "0"], cwd=REPO, capture_output=True, text=True, timeout=60,
                       env={**subprocess_env(), "OUT": "/tmp/cuda-suite-refused"})
    assert "P=0 is not a process count" in _one_line(r, 2)


def test_a_study_whose_run_crashed_is_not_read_as_a_gate_that_fell_short():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gate_noise", REPO / "jobs" / "gate_noise.py")
    gate_noise = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate_noise)
    assert gate_noise.worst([0, 0]) == 0 and gate_noise.worst([0, 1]) == 1 and gate_noise.worst([1, 3, 0]) == 3


# --- 3. environment and I/O faults ----------------------------------------------------------------

def test_a_lock_dir_that_does_not_exist_yet_is_made(tmp_path):
    env = {**subprocess_env(), "SPEC_HARNESS_LOCK_DIR": str(tmp_path / "new" / "locks")}
    r = subprocess.run([sys.executable, "-m", "harness", *TINY, f"out_dir={tmp_path / 'out'}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert list((tmp_path / "new" / "locks").glob("spec-harness-device-*.lock"))


@pytest.mark.parametrize("variable", ["SPEC_HARNESS_LOCK_DIR", "SPEC_HARNESS_HOME"])
def test_a_folder_variable_that_cannot_be_made_is_one_line_naming_it(tmp_path, variable):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**subprocess_env(), variable: str(blocker / "sub")}
    r = subprocess.run([sys.executable, "-m", "harness", *TINY, f"out_dir={tmp_path / 'out'}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    line = _one_line(r, 2)
    assert f"{variable}={blocker / 'sub'}" in line and "Not a directory" in line
    assert not list(tmp_path.rglob("*.json"))


def test_a_full_disk_is_exit_3_and_one_line_naming_out_dir(tmp_path):
    # ulimit -f: writes past 2 KiB fail with EFBIG (Python ignores SIGXFSZ), as on a full disk.
    out = tmp_path / "out"
    cmd = f"ulimit -f 2; exec {sys.executable} -m harness {' '.join(TINY)} out_dir={out}"
    r = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    line = _one_line(r, 3)
    assert f"cannot write the record {out}/" in line and "(out_dir)" in line and "size limit" in line


def test_an_out_dir_turned_into_a_file_mid_run_keeps_the_measured_record(tmp_path, monkeypatch):
    from harness import run
    from harness.faults import Fault, name_path

    monkeypatch.setenv("SPEC_HARNESS_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    out.write_text("not a folder")  # what the record's folder became while the cell ran
    name_path(out, "out_dir")
    with pytest.raises(Fault) as e:
        run._write_or_rescue(out / "cell.json", {"cell": {}, "measured": 1}, "cell")
    kept = Path(str(e.value).split("the measured record is kept at ")[1].split(":")[0])
    assert json.loads(kept.read_text()) == {"cell": {}, "measured": 1} and kept.parent == tmp_path / "home" / "rescued"
    assert "(out_dir)" in str(e.value) and "File exists" in str(e.value)


def test_os_errors_name_the_setting_that_chose_the_path(tmp_path):
    import errno

    from harness.faults import exit_for, name_path, os_error_line

    name_path(tmp_path / "results", "out_dir")
    line = os_error_line(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "results" / "a" / "b.json")))
    assert "(out_dir)" in line and "free space" in line and "rerun the same command" not in line
    assert exit_for(OSError(errno.EACCES, "Permission denied", "/x"), "app") == 3
    assert exit_for(RuntimeError("boom"), "app") == 3 and exit_for(ConfigError("bad"), "app") == 2
    assert exit_for(KeyboardInterrupt(), "app") == 130


# --- 4. numbers nobody checked ---------------------------------------------------------------------

def _cfg(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("override, words", [
    ("bench.temperature=nan", "bench.temperature=nan is not a finite number"),
    ("bench.temperature=inf", "bench.temperature=inf is not a finite number"),
    ("bench.reps=99999999999999999999", "bench.reps=99999999999999999999 is above the bound 1000"),
    ("bench.max_new_tokens=1", "bench.max_new_tokens=1 is not valid; it must be >= 2"),
    ("bench.context=99999999", "bench.context=99999999 is above the bound"),
    ("method.request_timeout_s=-inf", "method.request_timeout_s=-inf is not a finite number"),
])
def test_every_number_is_checked_before_anything_runs(override, words):
    method = ["method=subprocess", "method.command=engine"] if "method." in override else []
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.")):
        validate(_cfg(*method, override))


def test_nan_temperature_on_the_command_line_is_exit_2_with_nothing_written(tmp_path):
    r = harness(*TINY, "bench.temperature=nan", f"out_dir={tmp_path / 'out'}")
    assert "bench.temperature=nan" in _one_line(r, 2)
    assert not (tmp_path / "out").exists()


def _numeric_settings(schema=Config, prefix: str = "") -> list[str]:
    """Every int or float setting of the schema (Optional ones included, bools not), nested sections too:
    read from the dataclasses, so a numeric setting added later is fuzzed without editing this test."""
    hints, keys = typing.get_type_hints(schema), []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)] if typing.get_origin(kind) is typing.Union else []
        kind = args[0] if len(args) == 1 else kind
        if dataclasses.is_dataclass(kind):
            keys += _numeric_settings(kind, f"{prefix}{f.name}.")
        elif kind in (int, float):
            keys.append(prefix + f.name)
    return keys


NUMERIC = _numeric_settings()
READER = {"block_size": "ngram", "min_ngram": "ngram", "max_ngram": "ngram", "depth": "eagle3", "top_k": "eagle3",
          "total_tokens": "eagle3", "startup_timeout_s": "subprocess", "request_timeout_s": "subprocess",
          "draft_threshold": "draft_model", "accepted": "dflash_a", "rate": "dflash_a", "seed": None}


def test_the_fuzzed_settings_cover_every_section_of_the_schema():
    assert {"bench.temperature", "bench.context", "method.block_size", "method.draft_threshold",
            "method.force.accepted", "method.force.rate", "kv.group_size", "dispatch.stage_every",
            "lock_timeout_s"} <= set(NUMERIC)
    assert not any(k.endswith(("profile", "workload", "force")) for k in NUMERIC)  # bools and sections are not numbers


HOSTILE = ["nan", "inf", "-inf", "1e300", "99999999999999999999", "-1", "abc", "[1]", "true", "0"]


@pytest.mark.parametrize("key", NUMERIC)
def test_fuzzing_a_numeric_setting_gives_a_config_error_or_a_bounded_value(key):
    method = READER.get(key.split(".")[-1]) if key.startswith("method.") else None
    extra = [f"method={method}"] + (["method.command=engine"] if method == "subprocess" else []) if method else []
    for value in HOSTILE:
        try:
            cfg = _cfg(*extra, f"{key}={value}")
            validate(cfg)
        except ConfigError:
            continue
        except Exception as e:  # noqa: BLE001 -- Hydra refusing the type is the other acceptable answer
            assert type(e).__module__.startswith(("hydra", "omegaconf")), (key, value, repr(e))
            continue
        got = _get(cfg, key)
        assert got is None or isinstance(got, bool) or (math.isfinite(got) and abs(got) <= 2**63), (key, value, got)


def _get(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def test_a_command_with_an_unclosed_quote_is_a_config_error_naming_the_setting():
    with pytest.raises(ConfigError, match=r"method\.command=.*No closing quotation"):
        validate(_cfg("method=subprocess", "method.command='python \"x'"))


# --- 5. text that is not UTF-8 --------------------------------------------------------------------

def test_a_context_file_that_is_not_utf8_names_the_file_and_the_setting(tmp_path):
    from harness.context import _open

    path = tmp_path / "ctx.jsonl"
    path.write_bytes(b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n')
    with pytest.raises(ConfigError, match=rf"bench\.context_source={path}: not UTF-8 text"):
        list(_open(str(path))[1])  # the file is read as build() consumes it


def test_a_suite_file_that_is_not_utf8_names_the_file_and_the_setting(tmp_path):
    from harness.prompts import load_suite

    path = tmp_path / "suite.jsonl"
    path.write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(ConfigError, match=rf"bench\.suite: prompt file {path} is not UTF-8"):
        load_suite(str(path))
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # never opened: a FIFO would block
        load_suite(str(fifo))


# --- 6. a sweep is validated whole before its first cell --------------------------------------------

def test_a_sweep_with_a_bad_third_value_runs_nothing(tmp_path):
    out = tmp_path / "out"
    ctx = write_jsonl(tmp_path / "ctx.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                                   {"from": "gpt", "value": "hello"}]}])
    r = harness("-m", *TINY, "bench.context=0,99999,64", f"bench.context_source={ctx}", f"out_dir={out}")
    line = _one_line(r, 2)
    assert "job 2 of 3" in line and "bench.context=99999" in line and "holds 4096" in line
    assert not out.exists() or not list(out.rglob("*.json"))


def test_a_sweep_value_of_the_wrong_type_is_one_line(tmp_path):
    r = harness("-m", *TINY, "bench.context=0,abc", f"out_dir={tmp_path / 'out'}")
    assert "job 2 of 2" in (line := _one_line(r, 2)) and "bench.context" in line and "abc" in line


def test_the_report_names_the_code_each_record_ran():
    from report.document import _code_lines

    def rec(cid, source):
        code = {"source_sha256": source, "mlx": "0.32.4", "mlx_lm": "0.32.2"} if source else None
        return (None, {"cell_id": cid, "env": {"git": {"sha": "abc123", "dirty": False}},
                       **({"inputs": {"code": code}} if code else {})})

    assert _code_lines([rec("a", "1" * 64), rec("b", "1" * 64)]) == [
        "- Code: every record ran source 111111111111 (git abc123), mlx 0.32.4, mlx-lm 0.32.2"]
    lines = _code_lines([rec("a", "1" * 64), rec("b", "2" * 64), rec("c", None)])
    assert "3 versions of the code" in lines[0] and len(lines) == 4
    assert any("made before records named their code" in ln and "(c)" in ln for ln in lines)


@pytest.mark.parametrize("bound", [".nan", ".inf", "-.inf", "1e400", "abc", "[1]", "true", "null"])
def test_fuzzing_a_gate_bound_gives_a_config_error_or_a_finite_bound(tmp_path, bound):
    from hydra import compose as hcompose

    from harness.preflight import Seen, check_gate

    conf = _gate_dir(tmp_path, "gate:\n  name: tiny\n  checks:\n    - name: c\n      overrides: [arch=llama]\n"
                               f"      min: {{speedup: {bound}}}\n")
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        try:
            cfg = hcompose(config_name="config", overrides=[f"hydra.searchpath=[file://{conf}]", "+gate=tiny"])
            check_gate(cfg.gate, ["+gate=tiny", "bench=smoke"], hcompose, Seen())
        except ConfigError as e:
            assert "speedup" in str(e) or "min" in str(e), str(e)
            return
        except Exception as e:  # noqa: BLE001 -- Hydra refusing the type is the other acceptable answer
            assert type(e).__module__.startswith(("hydra", "omegaconf")), repr(e)
            return
    assert math.isfinite(cfg.gate.checks[0].min["speedup"])
