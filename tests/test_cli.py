"""The command line as users run it: sweeps, reports, resumption and bad input."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from harness.fixtures import fixture_dir
from tests.conftest import write_jsonl

REPO = Path(__file__).resolve().parent.parent
QUICK = ["bench=smoke", "bench.max_prompts=2", "bench.max_new_tokens=12", "bench.warmup=0"]
# dflash and mtp cells add a calibration and two context-scaling runs: keep prompts few.


def harness(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})


def records(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_qwen35_sweep_then_report_end_to_end_and_rerun_skips(tmp_path):
    out = tmp_path / "sweep"
    sweep = ["+sweep=qwen35", "method.block_size=2,4"]  # the sweep's methods and kv dtypes, two block sizes
    r = harness(*sweep, *QUICK, f"out_dir={out}")
    assert r.returncode == 0, r.stderr
    recs = records(out)
    # the float32 target's weights: every checkpoint tensor but the MTP head's (a drafter, loaded apart)
    tensors = mx.load(str(fixture_dir("qwen35") / "model.safetensors"))
    qwen35_bytes = 4 * sum(t.size for k, t in tensors.items() if not k.startswith("mtp."))
    # base and eagle3 x 2 kv (block size ignored, so run once each)
    # + (ngram, dflash_a, dflash_c, mtp) x 2 block sizes x 2 kv
    assert len(recs) == 20, sorted(recs)
    assert all(rec["status"] == "ok" for rec in recs.values()), [rec.get("reason") for rec in recs.values()]
    assert r.stderr.count("same cell as an earlier job") == 4
    ngram = [rec for rec in recs.values() if rec["cell"]["method"]["name"] == "ngram"]
    assert {rec["cell"]["method"]["block_size"] for rec in ngram} == {2, 4}
    dflash = [rec for rec in recs.values() if rec["cell"]["method"]["name"].startswith("dflash")]
    assert len(dflash) == 8 and all("drafter_fwd" in r["prompts"][0]["rounds_detail"]["phase_ms"] for r in dflash)
    assert all(r["calibration"]["context_scaling"]["long"]["verify_ms"] for r in dflash)
    for rec in recs.values():
        assert rec["env"]["mlx"] and rec["env"]["blas"] and "sha" in rec["env"]["git"]
        ceiling = rec["ceiling"]  # weight bytes of the float32 fixture, read once per token at the probed rate
        assert ceiling["weight_bytes"] == qwen35_bytes and ceiling["dtype"] == "float32"
        assert ceiling["tps"] == pytest.approx(ceiling["stream_gbs"] * 1e9 / qwen35_bytes)
        item = rec["prompts"][0]
        assert item["n_tokens"] == 12 and len(item["tokens"]) == 12
        assert item["first_divergence"] is None and item["matched_prefix"] == 12
        assert item["tau"] >= 1.0 and sum(item["accept_hist"]) == item["rounds"]
        assert {"draft", "verify", "accept", "rollback"} <= set(item["rounds_detail"]["phase_ms"])
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("*.json")}

    rep = subprocess.run([sys.executable, "-m", "report", str(out)], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert rep.returncode == 0, rep.stderr
    assert "### qwen35" in rep.stdout and "| method" in rep.stdout
    assert f"Weights {qwen35_bytes / 1e6:.2f} MB. Decode ceiling" in rep.stdout
    table_rows = [line for line in rep.stdout.splitlines()
                  if line.startswith(("| base", "| ngram", "| dflash", "| mtp", "| eagle3"))]
    assert len(table_rows) == 20
    assert (out / "report.csv").exists() and (out / "prompts.csv").exists()

    again = harness(*sweep, *QUICK, f"out_dir={out}")
    assert again.returncode == 0
    assert again.stderr.count("already recorded") == 20
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.json")} == mtimes


def test_a_failing_cell_is_recorded_and_the_sweep_goes_on(tmp_path):
    broken = tmp_path / "broken-ckpt"
    shutil.copytree(fixture_dir("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = tmp_path / "out"
    r = harness("-m", f"arch.model={broken},fixture:gemma4,fixture:llama", "kv=q8", *QUICK, f"out_dir={out}")
    assert r.returncode == 0, r.stderr
    by_model = {rec["cell"]["arch"]["model"]: rec for rec in records(out).values()}
    assert by_model[str(broken)]["status"] == "error" and by_model[str(broken)]["reason"]
    assert by_model["fixture:gemma4"]["status"] == "unsupported"
    assert "share" in by_model["fixture:gemma4"]["reason"]
    assert by_model["fixture:llama"]["status"] == "ok"


def _bad_inputs(tmp: Path):
    empty = tmp / "empty"
    empty.mkdir()
    malformed = tmp / "bad.jsonl"
    malformed.write_text('{"turns": ["ok"]}\n{oops\n')
    write_jsonl(tmp / "good.jsonl", [{"turns": ["fine"]}])
    return {
        "missing model dir": (["arch.model=/nonexistent/model"], "does not exist"),
        "dir without config.json": ([f"arch.model={empty}"], "no config.json"),
        "unknown method": (["method=foo"], "available: base, control, control_b8, dflash_a, dflash_c, dflash_zlab, eagle3, mlx_lm, mtp, ngram, ngram_b8"),
        "block_size=1": (["method=ngram", "method.block_size=1"], "block_size"),
        "missing prompt file": ([f"bench.suite={tmp / 'nope.jsonl'}"], "does not exist"),
        "unreadable prompt file": ([f"bench.suite={tmp}"], "cannot be read"),
        "malformed prompt file": ([f"bench.suite={malformed}"], "bad.jsonl:2"),
        "typo in a key": (["method.blok_size=3"], "unknown key"),
    }


@pytest.mark.parametrize("case", ["missing model dir", "dir without config.json", "unknown method", "block_size=1",
                                  "missing prompt file", "unreadable prompt file", "malformed prompt file",
                                  "typo in a key"])
def test_bad_input_gives_one_line_error_and_no_record(tmp_path, case):
    args, expect = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    r = harness(*args, *QUICK, f"out_dir={out}")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert expect in lines[0]
    assert not out.exists() or not list(out.glob("*.json"))
