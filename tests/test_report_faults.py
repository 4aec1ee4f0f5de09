"""`python -m report` is a transaction under every fault, robust to damaged records, and fast.

Every output is staged and moved in only when all are ready; a destination that cannot be
replaced is refused before anything moves; a move that fails puts the previous report back. A
record whose fields have the wrong type, or whose values the report cannot use, is named and
left out like any other non-record; only regular files are opened; thousands of records are
reported in well under two minutes. The records come from a real run (docs/benchmarks)."""

import contextlib
import copy
import errno
import io
import json
import math
import os
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from harness.records import record_problem
from report import __main__ as report_main
from report import plots, publish
from tests.test_cli import REPO

RUN = REPO / "docs/benchmarks/2026-12-06-cpu-first-run-d66628d/records.tgz"  # six cells of a real first run
NGRAM = "smollm2__ngram-bs4__kv-native__be36bb8f9d.json"  # ok, drafting, profiled, every per-round column
BASE = "smollm2__base__kv-native__9399c71e4c.json"


def real_records() -> dict[str, dict]:
    with tarfile.open(RUN) as tar:
        return {m.name: json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith(".json")}


@pytest.fixture(scope="module")
def run_records():
    return real_records()


@pytest.fixture
def two(run_records):
    """An n-gram cell and base decoding, from the real run."""
    return {k: run_records[k] for k in (NGRAM, BASE)}


@pytest.fixture
def quick_plots(monkeypatch):
    """Plots built but not rendered (a placeholder file each): where the plots are not the subject."""
    def placeholder(fig, path):
        plots.plt.close(fig)
        path.write_bytes(b"png")
        return path

    monkeypatch.setattr(plots, "_save", placeholder)


def write_run(root: Path, records: dict[str, dict]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, rec in records.items():
        (root / name).write_text(json.dumps(rec))
    return root


def report(*argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python -m report *argv`, run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = report_main.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def errors(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error: ")]


def outputs(root: Path) -> dict[str, bytes]:
    """The report files in `root`, by name (what a failed report must leave as it was)."""
    return {f.name: f.read_bytes() for f in root.iterdir() if f.name in publish.OUTPUTS and f.is_file()}


def no_staging(root: Path) -> bool:
    return not list(root.glob(publish.PREFIX + "*"))


@pytest.fixture
def reported(tmp_path, two, quick_plots):
    """A results dir with a written report, and one record changed since, so the next report differs."""
    root = write_run(tmp_path / "run", two)
    assert report(root)[0] == 0
    before = outputs(root)
    assert len(before) == 11  # report.md, five CSVs, five plots
    rec = json.loads((root / NGRAM).read_text())
    rec["summary"]["speedup"] = 9.5
    (root / NGRAM).write_text(json.dumps(rec))
    return root, before


# -- the transaction -------------------------------------------------------------------------------

def test_a_folder_where_the_report_writes_a_file_is_refused_before_anything_moves(reported):
    root, before = reported
    (root / "profile.png").unlink()
    (root / "profile.png").mkdir()
    code, _, err = report(root)
    assert code == 3, err
    assert errors(err) == [f"error: cannot write the report: {root / 'profile.png'} is a folder where the report "
                           "writes a file; move it away, then rerun (nothing was replaced: the previous report files "
                           "are as they were)"]
    assert outputs(root) == {k: v for k, v in before.items() if k != "profile.png"}  # not one file replaced
    assert no_staging(root) and "Traceback" not in err


def test_report_md_a_folder_in_a_fresh_dir_leaves_no_output_at_all(tmp_path, two, quick_plots):
    root = write_run(tmp_path, two)
    (root / "report.md").mkdir()
    code, _, err = report(root)
    assert code == 3 and "report.md is a folder where the report writes a file" in errors(err)[0]
    assert outputs(root) == {} and no_staging(root)


def test_a_move_that_fails_midway_puts_the_previous_report_back(reported, monkeypatch):
    root, before = reported
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 9:  # the fifth file: four new files already in place
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real(src, dst)

    monkeypatch.setattr(publish.os, "replace", replace)
    code, _, err = report(root)
    assert code == 3
    (line,) = errors(err)
    assert line == (f"error: cannot write the report: {root / 'profiles.csv'}: No space left on device (the results "
                    "directory given to python -m report); free space on that disk, or point the setting elsewhere, "
                    "then rerun; the previous report files are left whole")
    assert outputs(root) == before and no_staging(root)


def test_a_disk_full_while_writing_a_plot_is_one_line_exit_3_and_the_previous_report_stays(reported, monkeypatch):
    root, before = reported

    def full(fig, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(plots, "_save", full)
    code, _, err = report(root)
    assert code == 3 and "Traceback" not in err
    (line,) = errors(err)
    assert line.startswith(f"error: cannot write the report: {root / 'speedup_vs_block.png'}: No space left on device "
                           "(the results directory given to python -m report); free space on that disk")
    assert outputs(root) == before and no_staging(root)


def test_an_unwritable_results_dir_is_one_line_naming_it_and_exit_2(tmp_path, two, monkeypatch):
    root = write_run(tmp_path / "ro", two)
    if os.geteuid() == 0:  # root writes through a read-only mode: refuse the staging folder as the OS would
        def refuse(prefix, dir):
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(dir, prefix + "x"))

        monkeypatch.setattr(publish.tempfile, "mkdtemp", refuse)
    else:
        root.chmod(0o555)
    try:
        code, out, err = report(root)
    finally:
        root.chmod(0o755)
    assert code == 2 and out == ""
    assert errors(err) == [f"error: cannot write the report into {root}: Permission denied; make it writable for "
                           "this user, or copy its records into a directory you can write and report there"]
    assert outputs(root) == {} and no_staging(root)


def test_a_failure_of_the_code_is_its_traceback_then_one_line_exit_3_and_ctrl_c_is_130(reported, monkeypatch):
    root, before = reported

    def broken(*a, **k):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(plots, "profile_bars", broken)
    code, _, err = report(root)
    assert code == 3 and "Traceback" in err and "RuntimeError: plot failed" in err
    assert errors(err)[-1].startswith(f"error: the report over {root} failed: RuntimeError: plot failed")

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "profile_bars", interrupt)
    code, _, err = report(root)
    assert code == 130 and errors(err) == ["error: interrupted; the previous report files are left whole"]
    assert outputs(root) == before and no_staging(root)


def test_outputs_the_new_report_does_not_write_go_with_the_previous_report(tmp_path, two, quick_plots):
    root = write_run(tmp_path, two)
    (root / "speedup_vs_context.png").write_bytes(b"from an older report")  # this run has one context
    assert report(root)[0] == 0
    assert not (root / "speedup_vs_context.png").exists() and (root / "report.md").exists()


def test_bad_input_is_one_line_and_exit_2(tmp_path, run_records):
    assert report(tmp_path / "none") == (2, "", f"error: {tmp_path / 'none'} is not a directory; pass the out_dir of "
                                                "a harness run (e.g. results/sweep-qwen35)\n")
    code, _, err = report(tmp_path)
    assert code == 2 and errors(err) == [f"error: no harness records under {tmp_path}; run `python -m harness "
                                         f"out_dir={tmp_path}` first"]
    rec = copy.deepcopy(run_records[NGRAM])
    rec["prompts"][0]["decode_tps"][0] = 0.0  # its only record damaged: nothing left to report
    write_run(tmp_path, {NGRAM: rec})
    code, _, err = report(tmp_path)
    assert code == 2 and f"{NGRAM} is a record whose values the report cannot use" in err
    assert errors(err) == [f"error: no harness records under {tmp_path} that the report can use; run `python -m "
                           f"harness out_dir={tmp_path}` first"] and outputs(tmp_path) == {}


# -- what is read ----------------------------------------------------------------------------------

def test_only_regular_files_are_read_a_fifo_socket_device_or_folder_is_named_and_skipped(tmp_path, two,
                                                                                          quick_plots):
    root = write_run(tmp_path, two)
    os.mkfifo(root / "fifo.json")  # opening it would wait for a writer forever
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock.json"))
    (root / "null.json").symlink_to("/dev/null")
    (root / "folder.json").mkdir()
    result = []
    worker = threading.Thread(target=lambda: result.append(report(root)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    sock.close()
    assert not worker.is_alive(), "the report hangs on a special file"
    code, _, err = result[0]
    assert code == 0, err
    md = (root / "report.md").read_text().split("## Files not read")[1]
    for name, kind in (("fifo", "a FIFO"), ("sock", "a socket"), ("null", "a character device"),
                       ("folder", "a directory")):
        assert f"warning: {root / name}.json is {kind}, not a regular file: never opened: left out" in err
        assert f"`{name}.json` is {kind}, not a regular file" in md
    assert report("--strict", root)[0] == 1


def test_damaged_records_are_named_left_out_and_the_rest_reported(tmp_path, run_records, quick_plots):
    recs = copy.deepcopy(run_records)
    wrong = recs.pop(NGRAM)
    wrong["summary"]["speedup"] = "fast"
    ragged = copy.deepcopy(wrong)
    ragged["summary"]["speedup"], ragged["cell_id"] = 1.1, "ragged"
    ragged["prompts"][1]["rounds_detail"]["drafted"].pop()
    zero = copy.deepcopy(ragged)
    zero["cell_id"] = "zero"
    zero["prompts"][1]["rounds_detail"]["drafted"].append(0)
    zero["prompts"][2]["base"]["decode_tps"][0] = 0.0  # a rate the paired speedup divides by
    root = write_run(tmp_path, {**recs, "wrong.json": wrong, "ragged.json": ragged, "zero.json": zero})
    code, out, err = report(root)
    assert code == 0, err
    said = {
        "wrong.json": "is a record whose summary.speedup is a str, not a number (damaged or edited by hand)",
        "ragged.json": "is a record whose prompts[1].rounds_detail columns differ in length (drafted 22, accepted 23, "
                       "emitted 23, position 23) (damaged or edited by hand)",
        "zero.json": "is a record whose values the report cannot use (ZeroDivisionError: float division by zero; "
                     "damaged or edited by hand)",
    }
    md = (root / "report.md").read_text()
    for name, why in said.items():
        assert f"warning: {root / name} {why}: left out of the report" in err
        assert f"- `{name}` {why}" in md
    df = pd.read_csv(root / "report.csv")
    assert sorted(df["cell_id"]) == sorted(r["cell_id"] for r in recs.values())  # the five others, whole
    assert "Traceback" not in err and report("--strict", root)[0] == 1


def test_a_nan_or_infinity_written_by_hand_reads_as_missing_or_is_refused(tmp_path, run_records):
    rec = copy.deepcopy(run_records[NGRAM])
    rec["summary"]["tau"] = float("inf")
    f = tmp_path / "inf.json"
    f.write_text(json.dumps(rec))  # json writes Infinity, and reads it back
    assert record_problem(f)[1] == "is a record whose summary.tau is inf, not a number (damaged or edited by hand)"
    rec["summary"]["tau"] = float("nan")
    f.write_text(json.dumps(rec))
    assert math.isnan(record_problem(f)[0]["summary"]["tau"])  # the tables show it as "-"


# -- the fuzz: every field the report reads, replaced by a wrong type --------------------------------

BAD = {"a string": "fast", "a list": [1.5], "a dict": {"x": 1}, "null": None, "NaN": float("nan"),
       "a huge number": 1e300, "a huge integer": 10 ** 30, "a negative number": -7}
# Not walked into: the raw config, and per-token or per-rep lists the report never reads by item.
SKIP = {"config", "tokens", "ms", "base_profile", "gguf", "arm_order", "n_tokens_reps", "prefill_s", "e2e_tps",
        "decode_tps_reps", "base_decode_tps_reps", "speedup_reps", "phase_host_ms", "types", "device_info"}


def field_paths(value, where=()):
    """Every path into a record (dict keys, a list's first item), containers and leaves alike."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*where, k)
            if k not in SKIP:
                yield from field_paths(v, (*where, k))
    elif isinstance(value, list) and value:
        yield (*where, 0)
        yield from field_paths(value[0], (*where, 0))


def dotted(path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def with_value(rec: dict, path, value) -> str:
    """`rec` as JSON text with the field at `path` set to `value` (`rec` itself left as it was)."""
    *parent, last = path
    node = rec
    for p in parent:
        node = node[p]
    old = node[last]
    node[last] = value
    try:
        return json.dumps(rec)
    finally:
        node[last] = old


@pytest.fixture(scope="module")
def fuzzed(run_records, tmp_path_factory):
    """Every field path x every bad value, on the n-gram record cut to one prompt (hundreds of
    copies report in seconds): [(path, value name, record text, why record_problem refused it or
    None)]. Each copy has a cell id of its own, but those whose cell_id is the damage."""
    base = copy.deepcopy(run_records[NGRAM])
    base["prompts"] = base["prompts"][:1]
    f = tmp_path_factory.mktemp("fuzz") / "one.json"
    cases = []
    for path in field_paths(base):
        for name, value in BAD.items():
            base["cell_id"] = f"fuzz-{len(cases)}"
            text = with_value(base, path, value)
            f.write_text(text)
            cases.append((path, name, text, record_problem(f)[1]))
    return cases


def test_a_field_of_the_wrong_type_is_refused_with_its_name_or_the_record_reads_whole(fuzzed):
    assert len(fuzzed) > 1500, len(fuzzed)  # every summary field, every prompt field and round column, ...
    refused = [(path, name, why) for path, name, _, why in fuzzed if why]
    for path, name, why in refused:
        named = dotted(path) in why or all(p in why for p in path if isinstance(p, str))
        assert named, f"{dotted(path)} = {name}: the reason does not name the field: {why}"
    for path, name, _, why in fuzzed:  # what the tables print is a number or nothing
        if path[:1] == ("summary",) and path[-1] in ("speedup", "tau", "prompts", "diverged_prompts") and not why:
            assert name in ("NaN", "a huge number", "a negative number", "null"), (dotted(path), name)
    assert len(refused) > 400, len(refused)


# The fields whose numbers reach a plot (the tables format any number).
PLOTTED = ("summary.speedup", "summary.tau", "summary.acceptance_rate", "summary.model", "prompts[0].accept_hist",
           "prompts[0].rounds_detail", "prompts[0].decode", "prompts[0].base", "prompts[0].drafted",
           "cell.method.block_size", "cell.bench.temperature", "cell.bench.context", "ceiling")


def test_records_with_any_field_of_any_type_report_or_are_named_never_a_failure(tmp_path, fuzzed):
    """Every case the reading side accepts is reported with the rest, or named as damaged: odd
    numbers in plotted fields in batches of plots.MANY cells (a panel and a legend entry each),
    all the rest in one batch past MANY (one image, one collection of lines)."""
    small, large = [], []
    for n, (path, name, text, why) in enumerate(fuzzed):
        if why is None:
            odd_number = name in ("NaN", "a huge number", "a negative number")
            (small if odd_number and dotted(path).startswith(PLOTTED) else large).append((f"fuzz-{n}.json", text))
    assert len(small) > plots.MANY and len(large) > plots.MANY
    for b, batch in enumerate([small[i:i + plots.MANY] for i in range(0, len(small), plots.MANY)] + [large]):
        root = tmp_path / f"batch{b}"
        root.mkdir()
        for name, text in batch:
            (root / name).write_text(text)
        code, _, err = report(root)
        assert code == 0 and "Traceback" not in err, err[-3000:]
        md = (root / "report.md").read_text()
        shown = {Path(p).name for p in pd.read_csv(root / "report.csv")["path"]}
        for name, _ in batch:  # each reported, or named on stderr and in report.md
            assert name in shown or (f"/{name} " in err and f"`{name}`" in md), name


# -- speed -------------------------------------------------------------------------------------------

def test_3000_records_are_reported_within_two_minutes(tmp_path, run_records):
    """3,000 cells (4 archs x 6 methods x 5 blocks x 5 kv x 5 contexts), each the real n-gram
    record cut to one prompt. Before the plots drew one panel, bar and legend entry per cell, 300
    real records took 57 s and 3,000 did not finish in 20 minutes; now about 20 s on 2 loaded cores."""
    rec = copy.deepcopy(run_records[NGRAM])
    rec["prompts"] = rec["prompts"][:1]
    cell = rec["cell"]
    for arch in ("smollm2", "qwen35", "llama", "gemma"):
        for method in ("ngram", "draft_model", "eagle3", "mtp", "dflash_a", "control"):
            for block in (2, 3, 4, 6, 8):
                for kv in ("native", "q8", "q4", "q2", "fp8"):
                    for context in (0, 256, 512, 1024, 2048):
                        cell["arch"]["name"], cell["method"]["name"], cell["method"]["block_size"] = arch, method, block
                        cell["kv"]["name"], cell["bench"]["context"] = kv, context
                        rec["cell_id"] = f"{arch}__{method}-bs{block}__kv-{kv}__c{context}"
                        (tmp_path / f"{rec['cell_id']}.json").write_text(json.dumps(rec))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "report", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(pd.read_csv(tmp_path / "report.csv")) == 3000 and took < 120
