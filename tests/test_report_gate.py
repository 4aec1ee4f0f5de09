"""Report documents and plots, perf gates, and resuming interrupted sweeps."""

import json
import signal
import subprocess
import sys
import time

import matplotlib.image as mpimg
import pytest

from harness.summary import base_step
from tests.test_cli import QUICK, REPO, harness, records

GATE = """# @package _global_
gate:
  name: impossible
  checks:
    - name: llama n-gram must be 1000x faster
      overrides: [arch=llama, method=ngram, method.block_size=3, bench.max_prompts=1]
      min: {speedup: 1000.0, tau: 1.0}
"""


def test_report_writes_markdown_csv_and_sane_pngs(tmp_path):
    out = tmp_path / "run"
    for args in (["arch=llama", "method=ngram", "method.block_size=3"],
                 ["arch=llama", "method=ngram", "method.block_size=5"],
                 ["arch=llama", "method=control", "method.block_size=3"],
                 ["arch=llama", "arch.dtype=bfloat16", "method=ngram", "method.block_size=3"]):
        assert harness(*args, *QUICK, "bench.reps=2", f"out_dir={out}").returncode == 0
    rep = subprocess.run([sys.executable, "-m", "report", str(out)], cwd=REPO, capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr
    md = (out / "report.md").read_text()
    for section in ("## Setup", "## Protocol", "## Results", "### llama", "## Divergence from the reference",
                    "## Per-round profile", "## Speedup model", "## Plots"):
        assert section in md
    assert "speedup [95% CI: reps]" in md and "over prompts [95% CI]" in md and "break-even alpha" in md
    # one arch in two dtypes: two tables, never one that mixes them
    assert "### llama [float32]" in md and "### llama [bfloat16]" in md and "### llama (" not in md
    for name in ("speedup_vs_block", "tau_histograms", "profile", "predicted_vs_measured"):
        img = mpimg.imread(out / f"{name}.png")
        h, w = img.shape[:2]
        assert 200 <= h <= 4000 and 200 <= w <= 6000, (name, img.shape)
        assert img.std() > 0.01, f"{name}.png is blank"
        assert f"({name}.png)" in md
    for csv in ("report.csv", "prompts.csv", "profiles.csv"):
        assert (out / csv).stat().st_size > 100
    # the control drafts nothing yet verifies a full block every round: the model charges it that verify
    control = next(json.loads(p.read_text()) for p in out.glob("llama__control*.json"))
    m, cal = control["summary"]["model"], control["calibration"]
    verify1 = base_step(control["prompts"])["verify_ms"]
    full = (cal["verify_ms_by_tokens"]["3"] / cal["decode_ms"] * verify1 + m["overhead_ms"]) / m["unit_ms"]
    assert m["drafted_rounds"].keys() == {"0"} and m["round_cost_ratio"] == pytest.approx(full)


def test_an_impossible_gate_exits_nonzero_with_a_readable_table(tmp_path):
    (tmp_path / "gate").mkdir()
    (tmp_path / "gate" / "impossible.yaml").write_text(GATE)
    r = harness(f"hydra.searchpath=[file://{tmp_path}]", "+gate=impossible", *QUICK, f"out_dir={tmp_path / 'o'}")
    assert r.returncode == 1, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| llama n-gram")]
    assert len(rows) == 2
    speed = next(row for row in rows if "speedup" in row)
    assert ">= 1000" in speed and "FAIL" in speed
    assert "pass" in next(row for row in rows if "tau" in row)
    assert "1 of 2 bounds fell short" in r.stderr


def test_the_report_says_a_two_rep_interval_bounds_nothing():
    from report.document import _few_reps_note

    rec = lambda cid, n: (None, {"cell_id": cid, "summary": {"speedup_reps": [1.1] * n}})  # noqa: E731
    assert _few_reps_note([rec("a", 3), rec("b", 1)]) == []
    (line,) = _few_reps_note([rec("a", 2), rec("b", 2), rec("c", 3)])
    assert "2 cell(s)" in line and "t = 12.71" in line and "bench.reps >= 3" in line


def test_a_gate_bound_without_a_value_says_why():
    from types import SimpleNamespace

    from harness.gate import evaluate

    check = SimpleNamespace(name="c", min={"speedup_ci_low": 1.0, "speedup_prompts_ci_low": 1.0, "speedd": 1.0}, max={})
    one_rep = {"status": "ok", "summary": {"speedup_reps": [1.2], "speedup_ci_low": None, "speedup_prompts_n": 1,
                                           "speedup_prompts_ci_low": None}}
    shown = {r[1]: r[3] for r in evaluate(check, one_rep)}
    assert shown["speedup_ci_low"] == "missing: a 95% CI needs >= 2 paired reps, this cell has 1 (raise bench.reps)"
    assert "needs >= 2 prompts" in shown["speedup_prompts_ci_low"] and "bench.max_prompts" in shown["speedup_prompts_ci_low"]
    assert "has no 'speedd'" in shown["speedd"]
    assert all(r[-1] == "FAIL" for r in evaluate(check, one_rep))


def test_a_gate_names_each_outlier_rep_with_its_arm_prompt_and_rate():
    from harness.gate import outliers

    record = {"cell": {"method": {"name": "base"}, "reference": "mlx_lm"}, "prompts": [
        {"id": "p0", "turn": 0, "decode_tps": [500.0, 510.0, 505.0], "outlier_reps": [],
         "base": {"decode_tps": [498.0, 150.0, 502.0], "outlier_reps": [1]}},
        {"id": "p1", "turn": 1, "decode_tps": [90.0, 400.0, 410.0], "outlier_reps": [0],
         "base": {"decode_tps": [400.0, 401.0, 402.0], "outlier_reps": []}}]}
    assert outliers(record) == ["p0 (turn 0), mlx_lm rep 1: 150.0 tok/s, the arm's median on it 498.0",
                                "p1 (turn 1), base rep 0: 90.0 tok/s, the arm's median on it 400.0"]
    record["cell"]["reference"] = None  # a method paired with base decoding, no base arm flagged
    record["prompts"][0]["base"]["outlier_reps"] = []
    assert outliers(record) == ["p1 (turn 1), base rep 0: 90.0 tok/s, the arm's median on it 400.0"]


def test_a_failed_gate_check_measured_on_a_busy_host_says_so(monkeypatch, capsys):
    from types import SimpleNamespace

    from harness import gate

    loads = {"quiet": 0.05, "busy": 0.43}
    checks = [SimpleNamespace(name=n, overrides=[], min={"speedup": 0.8}, max={}) for n in ("quiet", "busy", "busy ok")]
    records = {"quiet": 0.7, "busy": 0.7, "busy ok": 0.9}
    monkeypatch.setattr(gate, "_cell_config", lambda cfg, check: check.name)
    monkeypatch.setattr(gate, "run_cell", lambda name: name)
    monkeypatch.setattr(gate, "read_record", lambda path: {
        "status": "ok", "run": {"id": gate.RUN["id"]}, "cell": {"method": {"name": "ngram"}}, "prompts": [],
        "summary": {"speedup": records[str(path)]},
        "load": {"other_cpu_share": loads.get(str(path), 0.5)}})
    assert gate.busy_host({"load": {"other_cpu_share": 0.2}}) is None and gate.busy_host(None) is None
    assert gate.run_gate(SimpleNamespace(gate=SimpleNamespace(name="t", checks=checks))) == 1
    err = capsys.readouterr().err
    assert "2 of 3 bounds fell short" in err
    # only the failing check measured under load is named; a busy check that passed and a quiet one are not
    assert "'busy' was measured while other processes kept 43% of the CPUs busy" in err
    assert "'quiet' was" not in err and "'busy ok' was" not in err


def test_an_interrupted_sweep_resumes_with_only_the_missing_cells(tmp_path):
    out = tmp_path / "sweep"
    sweep = ["+sweep=qwen35", "method=base,ngram"]  # 6 distinct cells: enough to interrupt midway
    args = [sys.executable, "-m", "harness", *sweep, *QUICK, f"out_dir={out}"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(list(out.glob("*.json"))) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # the harshest interruption: no cleanup at all
    proc.wait()
    done = {p.name for p in out.glob("*.json")}
    assert 2 <= len(done) < 6, "the sweep was not interrupted midway"
    for p in done:  # whatever the kill hit, every visible record is complete
        assert json.loads((out / p).read_text())["status"] == "ok"
    again = harness(*sweep, *QUICK, f"out_dir={out}")
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("already recorded") == len(done)
    assert again.stderr.count(" -> ok") == 6 - len(done)
    assert len(records(out)) == 6
    assert not list(out.glob(".*.tmp"))


def test_report_warns_about_cells_measured_under_load_and_tables_mixing_hosts():
    import pandas as pd

    from report.tables import conditions_line

    quiet = pd.DataFrame([{"method": "ngram", "block_size": 3, "kv": "native", "host": "a", "other_cpu_share": 0.01}])
    assert conditions_line(quiet) == ""
    busy = pd.DataFrame([{"method": "ngram", "block_size": 3, "kv": "native", "host": "a", "other_cpu_share": 0.45},
                         {"method": "base", "block_size": None, "kv": "native", "host": "b", "other_cpu_share": 0.0}])
    text = conditions_line(busy)
    assert "Measured under load" in text and "45%" in text and "ngram b3 native" in text
    assert "mixes 2 hosts (a, b)" in text


def test_every_profile_phase_gets_its_own_colour():
    from report.plots import phase_colors

    phases = ["accept", "draft", "rollback", "verify", "embed", "extract", "drafter_fwd", "drafter_argmax",
              "mtp_first", "mtp_chain", "commit_pass", "tree_expand"]
    colors = phase_colors(phases)
    assert len(set(colors.values())) == len(phases)
    assert len(set(phase_colors([f"p{i}" for i in range(30)]).values())) == 30
