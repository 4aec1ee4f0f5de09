"""Issue 32's numbered cases, replayed from the command line: each case's exit code and the one
line a user sees (an `error:` line, a cell's `->` line, a `warning:`, or what stdout shows).

    python docs/benchmarks/2026-12-04-hostile-input/cases.py [out.md]

Runs on the CPU fixtures in a temporary folder (about 10 minutes on 2 cores) and writes a
markdown table (default: cases.md beside this file). The misbehaving engines and servers are
the test suite's own (tests/test_outside.py), started on 127.0.0.1; every case is bounded in time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from tests.test_draft_model import _renumbered_tokenizer  # noqa: E402
from tests.test_hostile import interrupt_mid_cell  # noqa: E402
from tests.test_outside import ENGINES, FAKE_SERVER, _free_port  # noqa: E402
from tests.test_train import SMALL  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
SMOKE = ["arch=llama", "arch.dtype=float32", "bench=smoke", "bench.max_prompts=2", "bench.max_new_tokens=16",
         "bench.reps=2"]
QUICK = ["arch=llama", "bench=smoke", "bench.max_prompts=2", "bench.max_new_tokens=12", "bench.warmup=0"]


def cli(module: str, *args, timeout: int = 600) -> tuple[int, str, str, float]:
    """(exit code, stderr, stdout, seconds) of `python -m module args`."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=ENV, capture_output=True,
                       text=True, timeout=timeout)
    return r.returncode, r.stderr, r.stdout, time.perf_counter() - t0


def said(stderr: str, stdout: str = "") -> str:
    """The line a user reads: the last `error:`, else a cell's `->` line, else a `warning:`."""
    lines = stderr.splitlines()
    for test in (lambda s: s.startswith("error:"), lambda s: s.strip().startswith("-> "),
                 lambda s: s.startswith("warning:")):
        hits = [s.strip() for s in lines if test(s)]
        if hits:
            return hits[-1]
    return (stdout.strip().splitlines() or ["(nothing)"])[0]


def _script(tmp: Path, name: str, source: str) -> Path:
    path = tmp / name
    path.write_text(textwrap.dedent(source))
    return path


def _engine(tmp: Path, kind: str, *extra) -> tuple[int, str, float]:
    script = _script(tmp, f"{kind}.py", ENGINES[kind][0])
    rc, err, out, s = cli("harness", "method=subprocess", f"method.command='{sys.executable} {script}'",
                          "method.startup_timeout_s=2", "method.request_timeout_s=20", *SMOKE, *extra,
                          f"out_dir={tmp / kind}")
    return rc, said(err, out), s


def _server(tmp: Path, mode: str, *extra, port: int | None = None) -> tuple[int, str, float]:
    port = port or _free_port()
    script = _script(tmp, "server.py", FAKE_SERVER)
    rc, err, out, s = cli("harness", "method=server", f"method.url=http://127.0.0.1:{port}",
                          f"method.launch='{sys.executable} {script} {mode} {port}'", *SMOKE, *extra,
                          f"out_dir={tmp / ('server-' + mode)}")
    return rc, said(err, out), s


def case_held_port(tmp: Path):
    port = _free_port()
    old = subprocess.Popen([sys.executable, str(_script(tmp, "old.py", FAKE_SERVER)), "good", str(port)])
    try:
        time.sleep(2)
        return _server(tmp, "good", "method.startup_timeout_s=10", port=port)
    finally:
        old.kill()


def case_bare(tmp: Path, *args):
    rc, err, out, s = cli("harness", *args, "arch=llama", "bench=smoke", f"out_dir={tmp / 'bare'}")
    return rc, said(err, out), s


def case_train(tmp: Path, *args, out: str = "o"):
    rc, err, stdout, s = cli("harness.train", "arch=llama", f"out={tmp / out}", "train.steps=2",
                             f"data.cache_dir={tmp / 'train-data'}", *SMALL, *args)
    return rc, said(err, stdout), s


def case_resume_other_shape(tmp: Path):
    common = ["train=eagle3", "train.ckpt_every_steps=2"]
    rc, err, _, _ = cli("harness.train", "arch=llama", f"out={tmp / 'shape'}", "train.steps=2",
                        f"data.cache_dir={tmp / 'train-data'}", *SMALL, *common)
    assert rc == 0, err[-2000:]
    small = [a for a in SMALL if "intermediate_size" not in a]
    rc, err, out, s = cli("harness.train", "arch=llama", f"out={tmp / 'shape'}", "train.steps=4",
                          f"data.cache_dir={tmp / 'train-data'}", *small, *common, "train.intermediate_size=96")
    return rc, said(err, out), s


def case_contaminated(tmp: Path):
    sys.path.insert(0, str(REPO))
    from train.data import eval_texts

    texts, _ = eval_texts()
    prompts = tmp / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me a story."}) + "\n" + json.dumps({"turns": [texts["gsm8k"][0]]}))
    rc, err, out, s = cli("harness.train", "train=mtp", "arch=llama", f"out={tmp / 'dirty'}",
                          f"data.prompts={prompts}", "data.n_prompts=2", "data.eval_rows=1")
    left = "; no data cache left" if not (tmp / "dirty" / "data").exists() else "; DATA CACHE LEFT BEHIND"
    return rc, said(err, out) + left, s


def case_two_trainings(tmp: Path):
    first = subprocess.Popen([sys.executable, "-m", "harness.train", "train=mtp", "arch=llama", f"out={tmp / 'busy'}",
                              "train.steps=100000", f"data.cache_dir={tmp / 'train-data'}", *SMALL],
                             cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in first.stderr:  # the first holds the lock once it trains
            if "step " in line:
                break
        rc, err, out, s = cli("harness.train", "train=mtp", "arch=llama", f"out={tmp / 'busy'}", "train.steps=2",
                              f"data.cache_dir={tmp / 'train-data'}", *SMALL)
        return rc, said(err, out), s
    finally:
        first.kill()


def case_report_merged(tmp: Path, strict: bool):
    root = tmp / ("merged-strict" if strict else "merged")
    rc, err, _, _ = cli("harness", "method=ngram", *QUICK, f"out_dir={root / 'host1'}")
    assert rc == 0, err[-2000:]
    (rec_path,) = (root / "host1").glob("*.json")
    shutil.copytree(root / "host1", root / "host2")  # two hosts' results copied together
    rec = json.loads(rec_path.read_text())
    (root / "host3").mkdir()
    newer = {**rec, "started_at": "2999-01-01T00:00:00+00:00"}
    (root / "host3" / rec_path.name).write_text(json.dumps(newer))  # the same cell measured again
    (root / "host3" / "cut.json").write_text(json.dumps({**{k: v for k, v in rec.items() if k != "summary"},
                                                         "cell_id": "other"}))  # valid JSON, no summary
    other = {**rec, "cell_id": "suite2", "cell": {**rec["cell"], "bench": {**rec["cell"]["bench"], "suite": "mtbench"}}}
    (root / "host3" / "suite2.json").write_text(json.dumps(other))  # another suite's record
    rc, err, out, s = cli("report", *(["--strict"] if strict else []), root)
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    rows = sorted({ln.split("|")[1].strip() for ln in out.splitlines() if ln.startswith("| ngram")})
    if strict:
        return rc, said(err, out), s
    return rc, f"{len(warnings)} warnings, e.g. `{warnings[0]}`; rows: {rows}", s


def case_sampled_report(tmp: Path):
    rc, err, _, _ = cli("harness", "method=ngram", *QUICK, "bench.temperature=0.8", f"out_dir={tmp / 'sampled'}")
    assert rc == 0, err[-2000:]
    rc, err, out, s = cli("report", tmp / "sampled")
    md = (tmp / "sampled" / "report.md").read_text()
    start = md.index("Cells sampled at temperature")
    return rc, "report.md: " + md[start:md.index(".", start) + 1], s


def case_server_acceptance(tmp: Path):
    rc, _, s = _server(tmp, "good", "method.startup_timeout_s=20")
    rc2, err2, _, _ = cli("report", tmp / "server-good")
    md = (tmp / "server-good" / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| server"))
    cols = [c.strip() for c in row.split("|")]
    return rc2, f"cell exit {rc}; report row: tau `{cols[11]}`, accept `{cols[12]}`", s


def case_miscounts(tmp: Path):
    port = _free_port()
    script = _script(tmp, "server.py", FAKE_SERVER)
    rc, err, out, s = cli("harness", "method=server", f"method.url=http://127.0.0.1:{port}",
                          f"method.launch='{sys.executable} {script} miscounts {port}'", "method.startup_timeout_s=20",
                          *SMOKE, "bench.reps=1", f"out_dir={tmp / 'miscounts'}")
    warnings = [ln.strip() for ln in err.splitlines() if ln.strip().startswith("warning:")]
    return rc, (warnings or ["NO WARNING"])[0], s


def case_ctrl_c(tmp: Path):
    t0 = time.perf_counter()
    code, err = interrupt_mid_cell(tmp / "ctrlc")
    half = list((tmp / "ctrlc").glob("*.json"))
    return code, said(err) + ("; no record" if not half else "; A RECORD WAS WRITTEN"), time.perf_counter() - t0


def case_gate_few_reps(tmp: Path):
    (tmp / "gate").mkdir(exist_ok=True)
    (tmp / "gate" / "onerep.yaml").write_text(textwrap.dedent("""\
        # @package _global_
        gate:
          name: onerep
          checks:
            - name: llama n-gram CI
              overrides: [arch=llama, method=ngram, method.block_size=3, bench.max_prompts=1, bench.reps=1]
              min: {speedup_ci_low: 1.0}
        """))
    rc, err, out, s = cli("harness", f"hydra.searchpath=[file://{tmp}]", "+gate=onerep", *QUICK[1:],
                          f"out_dir={tmp / 'gate-out'}")
    row = next((ln for ln in out.splitlines() if "speedup_ci_low" in ln), said(err, out))
    return rc, row, s


def case_no_folder(tmp: Path):
    rc, err, out, s = cli("harness", "arch=llama", "method=subprocess", "bench=smoke",
                          f"out_dir={tmp / 'new' / 'run'}")
    return rc, said(err, out) + ("; no folder made" if not (tmp / "new").exists() else "; FOLDER LEFT"), s


def case_hydra(tmp: Path, module: str, *flags):
    rc, err, out, s = cli(module, *flags)
    text = err.strip() if rc else out.strip()
    first = next((ln for ln in text.splitlines() if ln.strip()), "(nothing)")
    return rc, first if rc else f"stdout {len(out.splitlines())} lines, first: `{first}`", s


CASES = [
    ("1", "launched server on a port an older server holds", case_held_port),
    ("2", "engine returns an id >= the vocabulary", lambda t: _engine(t, "id_past_the_vocabulary")),
    ("2", "engine returns a negative id", lambda t: _engine(t, "negative_id")),
    ("3", "`train=dflash train.mask_token_id=99999`", lambda t: case_train(t, "train=dflash",
                                                                             "train.mask_token_id=99999")),
    ("4", "`method=subprocess` without `method.command`", lambda t: case_bare(t, "method=subprocess")),
    ("4", "`-m method=base,subprocess` without a command", lambda t: case_bare(t, "-m", "method=base,subprocess")),
    ("4", "`method=server` without `method.url`", lambda t: case_bare(t, "method=server")),
    ("5", "server sends every token, then never ends its stream", lambda t: _server(
        t, "never_ends", "method.startup_timeout_s=20", "method.request_timeout_s=120")),
    ("5", "server trickles a piece a second forever", lambda t: _server(
        t, "trickles", "method.startup_timeout_s=20", "method.request_timeout_s=4")),
    ("5", "`method.url=127.0.0.1:8080` (no scheme)", lambda t: case_bare(t, "method=server",
                                                                           "method.url=127.0.0.1:8080")),
    ("6", "report over merged results: a copy, a newer duplicate, a record without summary, two suites",
     lambda t: case_report_merged(t, False)),
    ("6", "the same with `--strict`", lambda t: case_report_merged(t, True)),
    ("7", "draft model whose tokenizer swaps two ids (same size)", lambda t: (
        _renumbered_tokenizer(_fixture(), t / "dm"),
        case_bare(t, "method=draft_model", f"method.drafter={t / 'dm'}"))[1]),
    ("8", "training `out` is a file", lambda t: ((t / "afile").write_text("x"),
                                                case_train(t, "train=mtp", out="afile"))[1]),
    ("8", "training `out` under a file", lambda t: ((t / "afile").write_text("x"),
                                                   case_train(t, "train=mtp", out="afile/under"))[1]),
    ("8", "training `out` unwritable (`/proc/...`)", lambda t: case_bare_train_out(t, "/proc/spec-harness-x")),
    ("8", "`train.target_layer_ids=[0,99]`", lambda t: case_train(t, "train=dflash", "train.target_layer_ids=[0,99]")),
    ("8", "`train.aux_layer_ids=[-1,1,2]`", lambda t: case_train(t, "train=eagle3", "train.aux_layer_ids=[-1,1,2]")),
    ("8", "resume into a checkpoint of another drafter shape", case_resume_other_shape),
    ("8", "GSM8K question pasted into the training prompts", case_contaminated),
    ("8", "a second training into an `out` the first still writes", case_two_trainings),
    ("9", "engine claims accepted > drafted", lambda t: _engine(t, "accepted_more_than_drafted")),
    ("9", "engine emits more tokens than it accepted + 1", lambda t: _engine(t, "more_tokens_than_accepted")),
    ("10", "`python -m harness --cfg job`", lambda t: case_hydra(t, "harness", "--cfg", "job")),
    ("10", "`python -m harness -c hydra`", lambda t: case_hydra(t, "harness", "-c", "hydra")),
    ("10", "`python -m harness --resolve --cfg job method=ngram`",
     lambda t: case_hydra(t, "harness", "--resolve", "--cfg", "job", "method=ngram")),
    ("10", "`python -m harness --info defaults`", lambda t: case_hydra(t, "harness", "--info", "defaults")),
    ("10", "`python -m harness -m --cfg job method=base,ngram`",
     lambda t: case_hydra(t, "harness", "-m", "--cfg", "job", "method=base,ngram")),
    ("10", "`python -m harness.train --cfg job`", lambda t: case_hydra(t, "harness.train", "--cfg", "job")),
    ("10", "`python -m harness method=base,ngram` (a sweep value without -m)",
     lambda t: case_hydra(t, "harness", "method=base,ngram")),
    ("10", "`python -m harness method.block_size=[1` (a bad override)",
     lambda t: case_hydra(t, "harness", "method.block_size=[1")),
    ("11", "report over a cell sampled at T = 0.8", case_sampled_report),
    ("11", "server tokenized the prompt to another count", case_miscounts),
    ("11", "server arm's acceptance in the report", case_server_acceptance),
    ("11", "draft model with no weights", lambda t: ((t / "noweights").mkdir(),
                                                    (t / "noweights" / "config.json").write_text(
                                                        '{"model_type": "llama"}'),
                                                    case_bare(t, "method=draft_model",
                                                              f"method.drafter={t / 'noweights'}"))[2]),
    ("11", "bad input with a new `out_dir`", case_no_folder),
    ("11", "Ctrl-C during a timed turn", case_ctrl_c),
    ("11", "a CI bound on a cell of 1 rep", case_gate_few_reps),
]


def _fixture() -> Path:
    from harness.models.fixtures import fixture_dir

    return fixture_dir("llama")


def case_bare_train_out(tmp: Path, out: str):
    rc, err, stdout, s = cli("harness.train", "train=mtp", "arch=llama", f"out={out}", "train.steps=2", *SMALL)
    return rc, said(err, stdout), s


def main(argv: list[str]) -> int:
    """Replay every case, or those whose row numbers are given (`--only 3,17`), into a table."""
    only = {int(x) for x in argv[argv.index("--only") + 1].split(",")} if "--only" in argv else None
    argv = [a for i, a in enumerate(argv) if a != "--only" and (i == 0 or argv[i - 1] != "--only")]
    dest = Path(argv[0]) if argv else Path(__file__).with_name("cases.md")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i, (num, what, run) in enumerate(CASES, 1):
            if only and i not in only:
                continue
            tmp = Path(d) / f"case{i}"
            tmp.mkdir()
            try:
                rc, line, s = run(tmp)
            except Exception as e:  # a case that cannot be replayed is shown, not hidden
                rc, line, s = "-", f"REPLAY FAILED: {type(e).__name__}: {e}", 0.0
            line = line.replace(d, "<tmp>").replace("|", "\\|")
            print(f"[{i}/{len(CASES)}] {num} {what}: exit {rc} ({s:.0f} s) {line[:160]}", file=sys.stderr, flush=True)
            rows.append(f"| {num} | {what} | {rc} | {s:.0f} | {line} |")
    head = ["| case | input | exit | s | the line it gives |", "|---|---|---|---|---|"]
    dest.write_text("\n".join(head + rows) + "\n")
    print(f"{len(rows)} cases -> {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
