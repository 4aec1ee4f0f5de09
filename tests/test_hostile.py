"""Hostile input and shared machines: every absurd size is refused up front with its numbers,
a wait for the device says who holds it and can time out, exit codes tell failure from success,
Hydra's own failures are one line, and records are never silently lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from harness.bounds import fit_prompt, interpolate, verify_sizes
from harness.errors import ConfigError
from tests.conftest import subprocess_env
from tests.test_cli import QUICK, REPO, harness, records


def _errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.strip().splitlines() if ln.startswith("error: ")]


def test_a_block_larger_than_the_token_budget_is_refused_in_a_second_with_its_numbers(tmp_path):
    t0 = time.perf_counter()
    r = harness("arch=llama", "method=ngram", "bench=smoke", "method.block_size=1000", f"out_dir={tmp_path}")
    assert r.returncode == 2, r.stderr
    assert time.perf_counter() - t0 < 30
    (line,) = _errors(r.stderr)
    assert "method.block_size=1000" in line and "bench.max_new_tokens=24" in line
    assert not list(tmp_path.glob("*.json"))


def test_the_calibration_times_a_bounded_set_of_verify_sizes_whatever_the_block():
    assert verify_sizes(8) == list(range(1, 9))  # real blocks: every size, as before
    assert verify_sizes(16) == list(range(1, 17))
    big = verify_sizes(1000)
    assert big[:16] == list(range(1, 17)) and big[-1] == 1000 and len(big) <= 40
    assert all(b > a for a, b in zip(big, big[1:]))
    assert interpolate({1: 1.0, 5: 3.0}, 3) == 2.0 and interpolate({1: 1.0, 5: 3.0}, 5) == 3.0


def test_a_prompt_longer_than_the_context_is_refused_or_cut_only_when_asked():
    with pytest.raises(ConfigError, match=r"prompt 'p': 50000 prompt tokens \+ 8 new tokens \+ 3 .* need 50011 "
                                          r"positions; the model holds 4096 .*truncate_prompts=true .* last 4085"):
        fit_prompt(list(range(50000)), 8, 4, 4096, "prompt 'p'", truncate=False)
    ids, cut = fit_prompt(list(range(50000)), 8, 4, 4096, "prompt 'p'", truncate=True)
    assert cut == 50000 and ids == list(range(50000 - 4085, 50000))
    assert fit_prompt([1, 2, 3], 8, 4, 4096, "p", truncate=False) == ([1, 2, 3], None)
    with pytest.raises(ConfigError, match="lower bench.max_new_tokens"):
        fit_prompt([1], 5000, 4, 4096, "p", truncate=True)  # no room for even one prompt token


def _long_suite(tmp_path, words: int = 50000):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"question_id": "long-1", "category": "long", "turns": ["word " * words]}) + "\n")
    return path


def test_a_50000_token_prompt_on_a_4096_position_model_ends_in_seconds_with_exit_2(tmp_path):
    t0 = time.perf_counter()
    r = harness("arch=llama", "method=ngram", "bench=smoke", f"bench.suite={_long_suite(tmp_path)}",
                "bench.max_new_tokens=8", "method.block_size=4", f"out_dir={tmp_path / 'out'}")
    assert r.returncode == 2, r.stderr
    assert time.perf_counter() - t0 < 60
    (line,) = _errors(r.stderr)
    assert "prompt 'long-1'" in line and "the model holds 4096" in line and "truncate_prompts" in line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.json"))


def test_truncate_prompts_keeps_the_last_tokens_that_fit_and_records_the_cut(tmp_path):
    # The llama fixture with 512 positions instead of 4,096: the same cut, without a 4k-token
    # prefill and calibration on the reference BLAS (80 s there).
    from harness.models.fixtures import fixture_dir

    ckpt = tmp_path / "llama-512"
    shutil.copytree(fixture_dir("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    r = harness("arch=llama", f"arch.model={ckpt}", "method=ngram", "bench=smoke",
                f"bench.suite={_long_suite(tmp_path, 600)}", "bench.max_new_tokens=4", "method.block_size=2",
                "bench.truncate_prompts=true", "bench.reps=1", "bench.warmup=0", "bench.profile=false",
                f"out_dir={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    (rec,) = records(tmp_path / "out").values()
    (item,) = rec["prompts"]
    assert item["truncated_from"] > 512 and item["prompt_tokens"] == 512 - 4 - 1


def test_a_long_phase_says_it_is_still_running():
    from harness.heartbeat import Heartbeat

    heard = []
    beat = Heartbeat(every_s=0.05)
    beat.log = heard.append
    beat.start("the calibration")
    beat.beat(": a verify of 8 tokens")
    assert heard == []  # not before every_s has passed
    time.sleep(0.06)
    beat.beat(": a verify of 8 tokens")
    assert len(heard) == 1 and "still in the calibration: a verify of 8 tokens" in heard[0]


@pytest.mark.parametrize("out_dir", ["/proc/spec-harness-x", "{file}/x"])
def test_an_unusable_out_dir_is_one_line_naming_out_dir(tmp_path, out_dir):
    afile = tmp_path / "afile"
    afile.write_text("")
    r = harness("arch=llama", "method=ngram", "bench=smoke", f"out_dir={out_dir.format(file=afile)}")
    assert r.returncode == 2, r.stderr
    (line,) = _errors(r.stderr)
    assert line.startswith("error: out_dir=") and "Traceback" not in r.stderr and "HYDRA_FULL_ERROR" not in r.stderr


@pytest.mark.parametrize("bad,names", [("bench.reps=abc", "bench.reps"), ("bench.categories=x", "bench.categories"),
                                       ("method.block_size=[1", "cannot parse"),
                                       ("hydra.run.dir=/proc/spec-harness-y", "hydra.run.dir")])
def test_hydras_own_failures_are_one_line(tmp_path, bad, names):
    r = harness("arch=llama", "method=ngram", "bench=smoke", f"out_dir={tmp_path}", bad)
    assert r.returncode == 2, r.stderr
    (line,) = _errors(r.stderr)
    assert names in line and "Traceback" not in r.stderr and "HYDRA_FULL_ERROR" not in r.stderr


def test_exit_codes_tell_error_and_unsupported_from_ok():
    from harness.run import EXIT_CODES, exit_code, outcome_summary

    ok, err = {"cell": "a", "status": "ok", "reason": None}, {"cell": "b", "status": "error", "reason": "Boom: x\ny"}
    unsup = {"cell": "c", "status": "unsupported", "reason": "no drafter"}
    assert exit_code([ok], sweep=False) == 0
    assert exit_code([err], sweep=False) == EXIT_CODES["error"] == 3
    assert exit_code([unsup], sweep=False) == EXIT_CODES["unsupported"] == 4
    assert exit_code([ok, unsup], sweep=True) == 0  # an unsupported corner of a grid is an expected outcome
    assert exit_code([ok, unsup, err], sweep=True) == 3
    line = outcome_summary([ok, unsup, err])
    assert line == "3 cell(s): 1 error, 1 ok, 1 unsupported; failed: b (Boom: x)"


def test_a_single_unsupported_cell_exits_4_and_an_ok_one_0(tmp_path):
    r = harness("arch=gemma4", "method=ngram", "kv=q8", *QUICK, f"out_dir={tmp_path}")  # shared-KV layers
    assert r.returncode == 4, r.stderr
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "unsupported"


def _hold_device(release: threading.Event, held: threading.Event):
    from harness.device_lock import device_lock

    with device_lock():
        held.set()
        release.wait(60)


def test_a_wait_for_the_device_says_who_holds_it_and_times_out_cleanly(tmp_path):
    release, held = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_device, args=(release, held))
    holder.start()
    try:
        assert held.wait(30)
        t0 = time.perf_counter()
        r = harness("arch=llama", "method=ngram", *QUICK, "lock_timeout_s=2", f"out_dir={tmp_path}")
        took = time.perf_counter() - t0
    finally:
        release.set()
        holder.join()
    assert r.returncode == 5, r.stderr
    assert took < 60
    assert f"waiting for the device: held by pid {os.getpid()}" in r.stderr
    (line,) = _errors(r.stderr)
    assert "lock_timeout_s" in line and f"pid {os.getpid()}" in line
    assert not list(tmp_path.glob("*.json"))


def test_the_test_suite_takes_its_own_device_lock_not_the_hosts():
    import tempfile

    from harness.device_lock import device_lock_path

    assert os.environ["SPEC_HARNESS_LOCK_DIR"] != tempfile.gettempdir()
    assert device_lock_path().parent == __import__("pathlib").Path(os.environ["SPEC_HARNESS_LOCK_DIR"])


def test_the_same_cell_launched_twice_at_once_is_measured_once(tmp_path):
    env = subprocess_env()
    args = [sys.executable, "-m", "harness", "arch=llama", "method=ngram", *QUICK, f"out_dir={tmp_path}"]
    procs = [subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    measured = [o[1] for o in outs if "-> ok" in o[1]]
    skipped = [o[1] for o in outs if "already recorded" in o[1]]
    assert len(measured) == 1 and len(skipped) == 1, [o[1] for o in outs]
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_a_sweep_leaves_no_claim_files(tmp_path):
    r = harness("-m", "arch=llama", "method=base", "method.block_size=2,3", *QUICK, f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "same cell as an earlier job of this sweep" in r.stderr  # base ignores block_size: measured once
    assert len(records(tmp_path)) == 1
    assert not (tmp_path / ".claims").exists()
    assert r.stderr.strip().splitlines()[-1] == "sweep: 1 cell(s): 1 ok"


def test_report_names_a_corrupted_record_and_strict_fails_on_it(tmp_path):
    r = harness("arch=llama", "method=ngram", *QUICK, f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    (good,) = tmp_path.glob("*.json")
    broken = tmp_path / "llama__cut-short.json"
    broken.write_text(good.read_text()[:200])
    env = subprocess_env()
    rep = subprocess.run([sys.executable, "-m", "report", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         env=env)
    assert rep.returncode == 0, rep.stderr
    assert f"warning: {broken} is not valid JSON" in rep.stderr
    assert "llama__cut-short.json" in (tmp_path / "report.md").read_text().split("## Files not read")[1]
    strict = subprocess.run([sys.executable, "-m", "report", "--strict", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, env=env)
    assert strict.returncode == 1 and "1 file(s)" in strict.stderr


def test_a_single_cell_whose_target_fails_to_load_exits_3_with_an_error_record(tmp_path):
    import shutil

    from harness.models.fixtures import fixture_dir

    broken = tmp_path / "broken"
    shutil.copytree(fixture_dir("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{oops}")  # a cut-short header
    r = harness("arch=llama", f"arch.model={broken}", "method=ngram", *QUICK, f"out_dir={tmp_path / 'out'}")
    assert r.returncode == 3, r.stderr
    (rec,) = records(tmp_path / "out").values()
    assert rec["status"] == "error" and str(broken / "model.safetensors") in rec["reason"]


@pytest.mark.parametrize("args, said", [
    (["method=subprocess"], "method=subprocess needs method.command="),
    (["method=server"], "method=server needs method.url="),
    (["method=server", "method.url=127.0.0.1:8080"], "is not an http(s) URL"),
    (["-m", "method=base,subprocess"], "method=subprocess needs method.command="),
])
def test_an_outside_arm_without_what_reaches_it_is_bad_input_not_unsupported(tmp_path, args, said):
    t0 = time.perf_counter()
    r = harness(*args, "arch=llama", "bench=smoke", f"out_dir={tmp_path}")
    assert r.returncode == 2, r.stderr
    assert said in _errors(r.stderr)[-1]
    assert time.perf_counter() - t0 < 60  # no startup timeout waited out
    assert not [rec for rec in tmp_path.glob("*.json") if "subprocess" in rec.name or "server" in rec.name]


def _report(*args):
    return subprocess.run([sys.executable, "-m", "report", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=subprocess_env())


def test_the_report_reads_merged_results_one_row_per_cell_and_names_what_it_left_out(tmp_path):
    import json
    import shutil

    r = harness("arch=llama", "method=ngram", *QUICK, f"out_dir={tmp_path / 'host1'}")
    assert r.returncode == 0, r.stderr
    (rec_path,) = (tmp_path / "host1").glob("*.json")
    shutil.copytree(tmp_path / "host1", tmp_path / "host2")  # two hosts' results copied together
    rec = json.loads(rec_path.read_text())
    newer = {**rec, "started_at": "2999-01-01T00:00:00+00:00", "summary": {**rec["summary"], "speedup": 7.5}}
    (tmp_path / "host3").mkdir()
    (tmp_path / "host3" / rec_path.name).write_text(json.dumps(newer))  # the same cell measured again
    cut = {k: v for k, v in rec.items() if k != "summary"}
    (tmp_path / "host3" / "cut.json").write_text(json.dumps({**cut, "cell_id": "other"}))  # valid JSON, no summary
    out = _report(tmp_path)
    assert out.returncode == 0, out.stderr
    warnings = [ln for ln in out.stderr.splitlines() if ln.startswith("warning: ")]
    assert any("is a copy of" in w for w in warnings), warnings
    assert any("measures the same cell as" in w and "host3" in w for w in warnings), warnings
    assert any("cut.json is a record without summary.decode_tps" in w for w in warnings), warnings
    import pandas as pd

    df = pd.read_csv(tmp_path / "report.csv")
    assert len(df) == 1 and df["speedup"].iloc[0] == 7.5  # the newer measurement, once
    assert _report("--strict", tmp_path).returncode == 1


def interrupt_mid_cell(out_dir) -> tuple[int, str]:
    """(exit code, stderr) of a cell sent SIGINT after its first timed turn."""
    import signal

    env = subprocess_env()
    p = subprocess.Popen([sys.executable, "-m", "harness", "arch=llama", "method=ngram", "bench=smoke",
                          "bench.max_new_tokens=400", f"out_dir={out_dir}"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background job ignores it
    seen = []
    for line in p.stderr:  # interrupted mid-cell: after its first timed turn
        seen.append(line)
        if "turn 1/" in line:
            break
    p.send_signal(signal.SIGINT)
    _, rest = p.communicate(timeout=120)
    return p.returncode, "".join(seen) + rest


def test_ctrl_c_is_one_line_and_exit_130_with_nothing_half_written(tmp_path):
    code, err = interrupt_mid_cell(tmp_path)
    assert code == 130, err
    assert "Traceback" not in err and _errors(err)[-1].startswith("error: interrupted")
    assert not list(tmp_path.glob("*.json"))


def test_a_broken_draft_model_names_method_drafter_not_arch_model(tmp_path):
    (tmp_path / "dm").mkdir()
    (tmp_path / "dm" / "config.json").write_text('{"model_type": "llama"}')
    r = harness("arch=llama", "method=draft_model", f"method.drafter={tmp_path / 'dm'}", "bench=smoke",
                f"out_dir={tmp_path / 'out'}")
    assert r.returncode == 2
    line = _errors(r.stderr)[-1]
    assert "has no *.safetensors weights; set method.drafter to" in line and "arch.model" not in line


def test_the_report_does_not_call_divergence_at_temperature_a_bug(tmp_path):
    r = harness("arch=llama", "method=ngram", *QUICK, "bench.temperature=0.8", f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert _report(tmp_path).returncode == 0
    md = (tmp_path / "report.md").read_text()
    assert "Cells sampled at temperature > 0 (ngram) leave the greedy output by design" in md


@pytest.mark.parametrize("bad", [["method=subprocess"], ["method=ngram", "method.block_size=1000"]])
def test_bad_input_leaves_no_output_folder_behind(tmp_path, bad):
    r = harness("arch=llama", *bad, "bench=smoke", f"out_dir={tmp_path / 'new' / 'run'}")
    assert r.returncode == 2, r.stderr
    assert not (tmp_path / "new").exists()


def test_a_report_that_fails_midway_leaves_the_previous_one_whole_and_two_suites_make_two_rows(tmp_path,
                                                                                                monkeypatch):
    import json

    from report import document, plots
    from report.frames import cells

    r = harness("arch=llama", "method=ngram", *QUICK, f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    (rec_path,) = tmp_path.glob("*.json")
    rec = json.loads(rec_path.read_text())
    other = {**rec, "cell_id": "other", "cell": {**rec["cell"], "bench": {**rec["cell"]["bench"], "suite": "humaneval"}}}
    (tmp_path / "other.json").write_text(json.dumps(other))  # merged results of another suite
    methods = sorted(cells(tmp_path)["method"])
    assert methods == ["ngram (suite=builtin)", "ngram (suite=humaneval)"], methods
    document.write(tmp_path)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.suffix in (".md", ".csv", ".png")}
    (tmp_path / "other.json").unlink()  # the next report would differ...

    def broken(*a, **k):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(plots, "profile_bars", broken)  # ...but fails after its CSVs are made
    with pytest.raises(RuntimeError, match="plot failed"):
        document.write(tmp_path)
    after = {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.suffix in (".md", ".csv", ".png")}
    assert after == before and len(before) == 11  # the previous report, whole (depth.csv, tau_by_depth.png included)
    assert not list(tmp_path.glob(".report-*"))  # no staging left behind


def test_train_and_report_keep_the_benchmarks_exit_codes(tmp_path, monkeypatch, capsys):
    from report import __main__ as report_main
    from train.__main__ import guarded

    def crash(cfg):
        raise RuntimeError("nan in the loss")

    def refuse(cfg):
        raise ConfigError("train.steps=-1 must be > 0")

    def interrupt(cfg):
        raise KeyboardInterrupt

    assert guarded(lambda cfg: 0, None) == 0
    assert guarded(refuse, None) == 2 and capsys.readouterr().err == "error: train.steps=-1 must be > 0\n"
    assert guarded(interrupt, None) == 130 and capsys.readouterr().err.startswith("error: interrupted")
    assert guarded(crash, None) == 3
    err = capsys.readouterr().err
    assert "RuntimeError: nan in the loss" in err and err.strip().splitlines()[-1].startswith("error: training failed")
    assert report_main.main(["--help"]) == 0 and "usage:" in capsys.readouterr().out
    assert report_main.main([]) == 2
    assert report_main.main([str(tmp_path / "none")]) == 2
    (tmp_path / "r.json").write_text(json.dumps({"schema": 1}))
    assert report_main.main([str(tmp_path)]) == 2  # no readable record
    monkeypatch.setattr(report_main, "scan_records", lambda root: ([object()], []))
    monkeypatch.setattr(report_main, "write", crash)
    assert report_main.main([str(tmp_path)]) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: the report over")
