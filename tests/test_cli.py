"""The command line as users run it: sweeps, reports, resumption and bad input."""

import csv
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from harness.models.fixtures import fixture_dir
from harness.records import iter_records
from tests.conftest import REPO, subprocess_env, write_jsonl

QUICK = ["bench=smoke", "bench.max_prompts=2", "bench.max_new_tokens=12", "bench.warmup=0"]
# dflash and mtp cells add a calibration and two context-scaling runs: keep prompts few.


def harness(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900, env=subprocess_env())


def test_a_child_process_keeps_the_parents_pythonpath_behind_the_repo(tmp_path, monkeypatch):
    # The GPU machine's MLX, hydra and mlx-lm live on PYTHONPATH: a child given the repo alone
    # could not import hydra (test_quantized's harness run, 2026-12-05 on the H100).
    (tmp_path / "parent_only_module.py").write_text("WHERE = 'parent'\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    r = subprocess.run([sys.executable, "-c", "import parent_only_module, harness.errors; print(parent_only_module.WHERE)"],
                       cwd=tmp_path.parent, capture_output=True, text=True, env=subprocess_env())
    assert r.returncode == 0 and r.stdout.strip() == "parent", r.stderr


def records(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}


def test_qwen35_sweep_then_report_end_to_end_and_rerun_skips(tmp_path):
    out = tmp_path / "sweep"
    sweep = ["+sweep=qwen35", "method=base,dflash_a,ngram", "method.block_size=2,4", "kv=native"]  # two block sizes
    # (kv=q8 cells are the same code path per cell; test_quantized and the gates run them; every method's cells
    # run in tests/test_layouts.py and tests/test_quantized.py)
    r = harness(*sweep, *QUICK, f"out_dir={out}")
    assert r.returncode == 0, r.stderr
    recs = records(out)
    # the float32 target's weights: every checkpoint tensor but the MTP head's (a drafter, loaded apart)
    tensors = mx.load(str(fixture_dir("qwen35") / "model.safetensors"))
    qwen35_bytes = 4 * sum(t.size for k, t in tensors.items() if not k.startswith("mtp."))
    # base (block size ignored, so run once) + (dflash_a, ngram) x 2 block sizes
    assert len(recs) == 5, sorted(recs)
    assert all(rec["status"] == "ok" for rec in recs.values()), [rec.get("reason") for rec in recs.values()]
    assert r.stderr.count("same cell as an earlier job") == 1
    ngram = [rec for rec in recs.values() if rec["cell"]["method"]["name"] == "ngram"]
    assert {rec["cell"]["method"]["block_size"] for rec in ngram} == {2, 4}
    dflash = [rec for rec in recs.values() if rec["cell"]["method"]["name"].startswith("dflash")]
    assert len(dflash) == 2 and all("drafter_fwd" in r["prompts"][0]["rounds_detail"]["phase_ms"] for r in dflash)
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
                         env=subprocess_env())
    assert rep.returncode == 0, rep.stderr
    assert "### qwen35" in rep.stdout and "| method" in rep.stdout
    assert f"Weights {qwen35_bytes / 1e6:.2f} MB. Decode ceiling" in rep.stdout
    table_rows = [line for line in rep.stdout.splitlines()
                  if line.startswith(("| base", "| ngram", "| dflash", "| mtp", "| eagle3"))]
    assert len(table_rows) == 5
    assert (out / "report.csv").exists() and (out / "prompts.csv").exists()

    again = harness(*sweep, *QUICK, f"out_dir={out}")
    assert again.returncode == 0
    assert again.stderr.count("already recorded") == 5 and again.stderr.count("same cell as an earlier job") == 1
    assert again.stderr.strip().splitlines()[-1] == "sweep: 5 cell(s): 5 ok"
    assert {p: p.stat().st_mtime_ns for p in out.glob("*.json")} == mtimes


@pytest.fixture(scope="module")
def failed_sweep(tmp_path_factory):
    """A three-cell sweep ending error (unreadable weights), unsupported (q8 KV on gemma4's
    shared-KV layers) and ok: (its overrides, out_dir, the broken checkpoint, the run)."""
    tmp = tmp_path_factory.mktemp("failed-sweep")
    broken = tmp / "broken-ckpt"
    shutil.copytree(fixture_dir("llama"), broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    args = ["-m", f"arch.model={broken},fixture:gemma4,fixture:llama", "kv=q8", *QUICK]
    return args, tmp / "out", broken, harness(*args, f"out_dir={tmp / 'out'}")


def _by_model(out: Path) -> dict[str, tuple[Path, dict]]:
    return {rec["cell"]["arch"]["model"]: (p, rec) for p, rec in ((p, json.loads(p.read_text()))
                                                                 for p in out.glob("*.json"))}


def test_a_failing_cell_is_recorded_the_sweep_goes_on_and_exits_3_naming_it(failed_sweep):
    _, out, broken, r = failed_sweep
    assert r.returncode == 3, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("sweep: 3 cell(s): 1 error, 1 ok, 1 unsupported; failed: qwen35__base__kv-q8__"), last
    assert str(broken) in last  # the reason names the file that failed
    by_model = {model: rec for model, (_, rec) in _by_model(out).items()}
    assert by_model[str(broken)]["status"] == "error" and by_model[str(broken)]["reason"]
    assert by_model["fixture:gemma4"]["status"] == "unsupported"
    assert "share" in by_model["fixture:gemma4"]["reason"]
    assert by_model["fixture:llama"]["status"] == "ok"


def test_a_rerun_measures_error_and_unsupported_cells_again_and_skips_ok_ones(failed_sweep, tmp_path):
    args, src, broken, _ = failed_sweep
    out = tmp_path / "out"
    shutil.copytree(src, out)
    before = {model: (rec["cell_id"], p.stat().st_mtime_ns) for model, (p, rec) in _by_model(out).items()}
    shutil.copy(fixture_dir("llama") / "model.safetensors", broken / "model.safetensors")  # the error's cause, fixed
    r = harness(*args, f"out_dir={out}")
    assert r.returncode == 0, r.stderr
    after = _by_model(out)
    assert after[str(broken)][1]["status"] == "ok"  # measured again, and its weights read now
    unsupported_path, unsupported = after["fixture:gemma4"]
    assert unsupported["status"] == "unsupported" and unsupported_path.stat().st_mtime_ns != before["fixture:gemma4"][1]
    assert after["fixture:llama"][0].stat().st_mtime_ns == before["fixture:llama"][1]  # ok: left as it was
    skipped = [line for line in r.stderr.splitlines() if "already recorded" in line]
    assert len(skipped) == 1 and before["fixture:llama"][0] in skipped[0]


def _report(out: Path):
    return subprocess.run([sys.executable, "-m", "report", str(out)], cwd=REPO, capture_output=True, text=True,
                          env=subprocess_env())


def _table_rows(md: str) -> list[dict]:
    """Every markdown table row: {header: cell}, and under "cells" its cells as split at unescaped pipes."""
    split = lambda line: [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
    lines, rows, header = md.splitlines(), [], None
    for line, after in zip(lines, lines[1:] + [""]):
        if not line.startswith("|"):
            header = None
        elif after.startswith("|--"):
            header = split(line)
        elif header and not line.startswith("|--"):
            rows.append({**dict(zip(header, split(line))), "cells": split(line), "header": header})
    return rows


def test_a_report_over_error_and_unsupported_records_shows_the_ok_cell_and_lists_the_failed_ones(failed_sweep,
                                                                                                   tmp_path):
    _, src, broken, _ = failed_sweep
    out = tmp_path / "out"
    shutil.copytree(src, out)
    rep = _report(out)
    assert rep.returncode == 0, rep.stderr
    recs = {model: rec for model, (_, rec) in _by_model(out).items()}
    rows = _table_rows(rep.stdout)  # the per-arch cell tables
    assert len(rows) == 3
    md = (out / "report.md").read_text()
    assert all(line in md for line in rep.stdout.splitlines() if line.startswith("|"))  # the same tables there
    ok = recs["fixture:llama"]["summary"]
    speedup = lambda r: next(v for k, v in r.items() if k.startswith("speedup"))  # its header names the interval
    assert [r for r in rows if r["tok/s"] == f"{ok['decode_tps']:.1f}"
            and speedup(r).startswith(f"{ok['speedup']:.3f}x")]
    for model in (str(broken), "fixture:gemma4"):
        rec = recs[model]
        listed = [r["cells"] for r in rows if r["cells"][-1] == f"{rec['status']}: {rec['reason']}"]
        assert len(listed) == 1, (rec["status"], [r["cells"] for r in rows])
        assert set(listed[0][3:-1]) == {"-"}  # no numbers for a cell that did not run
    with open(out / "report.csv", newline="") as f:
        assert sorted(row["status"] for row in csv.DictReader(f)) == ["error", "ok", "unsupported"]


def test_a_failed_cells_multi_line_reason_stays_in_its_one_table_row(failed_sweep):
    from report.frames import cells
    from report.tables import arch_tables

    _, out, broken, _ = failed_sweep
    records = [(p, {**rec, "reason": "SafetensorError: invalid header\n  reading model.safetensors | shard 1 of 1"}
                if rec["cell"]["arch"]["model"] == str(broken) else rec) for p, rec in iter_records(out)]
    rows = _table_rows(arch_tables(cells(out, records)))  # what `python -m report` prints
    assert len(rows) == 3 and all(len(r["cells"]) == len(r["header"]) for r in rows), [r["cells"] for r in rows]


def _bad_inputs(tmp: Path):
    empty = tmp / "empty"
    empty.mkdir()
    malformed = tmp / "bad.jsonl"
    malformed.write_text('{"turns": ["ok"]}\n{oops\n')
    write_jsonl(tmp / "good.jsonl", [{"turns": ["fine"]}])
    return {
        "missing model dir": (["arch.model=/nonexistent/model"], "does not exist"),
        "dir without config.json": ([f"arch.model={empty}"], "no config.json"),
        "unknown method": (["method=foo"], "available: base, control, control_b8, ddtree, dflash_a, dflash_c, "
                                           "dflash_zlab, draft_model, eagle3, mlx_lm, mlx_lm_spec, mtp, ngram, ngram_b8, "
                                           "server, subprocess, suffix"),
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


FLAGS = [  # each of Hydra's command-line flags, as a user of any Hydra app types it, and what stdout shows
    (["--cfg", "job"], "arch:"),
    (["-c", "hydra"], "hydra:"),
    (["--resolve", "--cfg", "job", "{method}=dflash_a"], ": dflash"),
    (["--cfg=job", "{method}=mtp"], ": mtp"),
    (["--cfg", "job", "--package", "arch"], "# @package arch"),
    (["--info", "defaults"], "Defaults List"),
    (["--help"], "powered by Hydra"),
    (["--hydra-help"], "Hydra (1."),
]
APPS = {"harness": "method", "train": "train"}  # each app and the group its example override sets


@pytest.mark.parametrize("app", list(APPS))
@pytest.mark.parametrize("flags, shows", FLAGS)
def test_hydras_own_flags_and_their_values_are_not_read_as_overrides(app, flags, shows):
    from harness.flags import override_args

    flags = [f.format(method=APPS[app]) for f in flags]
    if app == "train":  # its option is dflash, the benchmark's dflash_a
        flags = [f.replace("=dflash_a", "=dflash") for f in flags]
    assert override_args(flags) == [a for a in flags if a.startswith(APPS[app] + "=")]
    r = subprocess.run([sys.executable, "-m", app, *flags], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=subprocess_env())
    assert r.returncode == 0, r.stderr
    assert shows in r.stdout


@pytest.mark.parametrize("app", list(APPS))
def test_a_sweep_value_without_multirun_is_one_line(app):
    r = subprocess.run([sys.executable, "-m", app, f"{APPS[app]}=mtp,ngram"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=subprocess_env())
    assert r.returncode == 2
    assert r.stderr.strip() == (f"error: {APPS[app]}=mtp,ngram lists several values: add -m (--multirun) to run "
                                "one job per value, or give one value")


@pytest.mark.parametrize("app", list(APPS))
def test_flags_hydra_refuses_together_are_one_line(app):
    r = subprocess.run([sys.executable, "-m", app, "-m", "--cfg", "job", f"{APPS[app]}=mtp,ngram"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: Only one of") and len(r.stderr.strip().splitlines()) == 1
