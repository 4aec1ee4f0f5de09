"""Fan-out through Hydra's launchers: the cluster configs compose, and a sweep run as separate
local jobs (submitit's local executor, the same plugin as SLURM) writes each cell once, takes
turns on the device, resumes only what a killed job left out, and reports as one."""

import fcntl
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir

from harness.config import conf_dir, register_configs
from harness.device_lock import device_lock_path
from tests.conftest import subprocess_env
from tests.test_cli import REPO, records

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install -e '.[cluster]'")


def _compose(*overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_slurm_and_ray_launcher_configs_compose_with_one_accelerator_per_cell(monkeypatch):
    slurm = _compose("+sweep=qwen35", "hydra/launcher=slurm", "out_dir=/shared/r")
    launcher = slurm.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.gpus_per_node == 1 and launcher.tasks_per_node == 1
    assert launcher.submitit_folder == "/shared/r/.submitit/%j"
    assert slurm.hydra.sweeper.params["method"].startswith("base,")
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    ray = _compose("+sweep=qwen35", "hydra/launcher=ray_cluster").hydra.launcher
    assert ray._target_ == "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
    assert ray.ray.remote.num_gpus == 1 and ray.ray.remote.max_calls == 1 and ray.ray.init.address == "head:6379"


def _sweep(out, hold_device_s: float = 0.0, **env):
    """Run the sweep as local jobs; with hold_device_s, this test holds the device lock for that
    long after launching, so every job must wait for it."""
    args = ["+sweep=qwen35", "method=base,ngram", "method.block_size=2,3", "kv=native", "hydra/launcher=local_jobs",
            "bench=smoke", "bench.max_prompts=2", "bench.max_new_tokens=16", "bench.warmup=0", "bench.profile=false",
            f"out_dir={out}"]
    with open(device_lock_path(), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=subprocess_env(**env))
        time.sleep(hold_device_s)
        released = time.time()
        fcntl.flock(lock, fcntl.LOCK_UN)
    out_, err = proc.communicate(timeout=900)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out_, err), released


def test_local_jobs_write_each_cell_once_take_turns_and_resume_only_the_killed_cell(tmp_path):
    out = tmp_path / "sweep"
    first, released = _sweep(out, hold_device_s=8.0, SPEC_HARNESS_TEST_KILL="ngram-bs3")  # that job dies
    assert first.returncode != 0  # Hydra reports the failed job
    recs = records(out)
    assert sorted(r["cell"]["method"].get("block_size") or 0 for r in recs.values()) == [0, 2]  # base once, ngram b2
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.json")}
    spans = sorted((r["device"]["held_from"], r["device"]["held_to"]) for r in recs.values())
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two cells timed on the device at once"
    assert all(r["device"]["held_from"] >= released for r in recs.values()), "a job timed while the device was held"
    assert all(r["env"]["host"] and r["load"]["cpus"] for r in recs.values())

    again, _ = _sweep(out)
    assert again.returncode == 0, again.stderr
    recs = records(out)
    assert len(recs) == 3 and all(r["status"] == "ok" for r in recs.values())
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.json") if p.name in mtimes} == mtimes  # not re-run
    rep = subprocess.run([sys.executable, "-m", "report", str(out)], cwd=REPO, capture_output=True, text=True,
                         env=subprocess_env())
    assert rep.returncode == 0, rep.stderr
    rows = [line for line in rep.stdout.splitlines() if line.startswith(("| base", "| ngram"))]
    assert len(rows) == 3
    assert len((out / "report.csv").read_text().splitlines()) == 4  # header + 3 cells
