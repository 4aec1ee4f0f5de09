"""jobs/graph_env.py: the device diagnostic runs end to end on the CPU and writes every cost it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_tiny_run_writes_each_cost_and_the_dispatch_variant(tmp_path):
    out = tmp_path / "costs.jsonl"
    r = subprocess.run([sys.executable, "jobs/graph_env.py", "--tiny", "--dispatch", "--bits", "4", "--label", "t",
                        "--methods", "eagle3", "dflash_a", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(out.read_text().splitlines()[-1])
    costs = ["step", "step_pipelined", "verify_2", "verify_8", "verify_16", "tree_16", "tree_16_bool_mask"]
    builds = ["build_step", "build_verify_2", "build_verify_8", "build_verify_16", "build_tree_16",
              "build_tree_16_bool_mask"]
    assert row["label"] == "t" and row["bits"] == 4 and all(row[k] > 0 for k in costs + builds + ["batch_4"])
    assert set(row["op_build_us"]) == {"add", "linear", "fast.rms_norm", "fast.rope", "fast.sdpa"}
    variant = row["stable=1,small_m=0"]  # off CUDA the one other pair: shape-stable attention forced on
    assert all(variant[k] > 0 for k in costs + builds)
    rounds = row["rounds"]  # each method's rounds through the harness's loop, phase by phase
    assert {"commit_pass", "tree_expand", "verify", "accept", "rollback"} <= set(rounds["eagle3"]["phase_ms"])
    assert {"drafter_fwd", "verify"} <= set(rounds["dflash_a"]["host_ms"]) and rounds["dflash_a"]["rounds"] >= 1
    assert all(0 < r["round_ms"] and r["host_ms"]["verify"] <= r["phase_ms"]["verify"] for r in rounds.values())
    summary = subprocess.run([sys.executable, "jobs/graph_env_summary.py", str(out)], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    lines = summary.stdout.splitlines()
    assert summary.returncode == 0 and len(lines) == 5, summary.stdout + summary.stderr  # header, 2 variants, 2 methods
    assert lines[1].startswith("t | default | ") and lines[2].startswith("t | stable=1,small_m=0 | ")
    assert lines[3].startswith("t | eagle3 rounds | commit_pass ") and lines[4].startswith("t | dflash_a rounds | ")


def test_tiny_with_a_method_it_has_no_drafter_for_is_refused_before_any_work(tmp_path):
    out = tmp_path / "costs.jsonl"
    r = subprocess.run([sys.executable, "jobs/graph_env.py", "--tiny", "--methods", "mtp", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "fixture drafters for eagle3 and dflash_a only" in r.stderr
    assert r.stdout == "" and not out.exists()  # no cost was timed or written
