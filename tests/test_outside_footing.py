"""Outside arms on the footing of the harness's own (issue 50, item 2): the processes the harness
starts run on its BLAS and the record says what each arm ran on; decode time ends at the last
token's arrival for every arm, and what comes after it (a late `done`, a stream left open) is kept
and warned about; counts that contradict the tokens, and an output short of its budget without a
stop token, are `error` records naming the engine and the values."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from engines.arms import outside
from engines.arms.external import ArmReportError
from engines.arms.outside import ServerArm, SubprocessArm
from engines.runtime.sampling import Sampler
from harness import blas
from harness.generation import run_generation
from harness.models.fixtures import fixture_dir
from tests.test_cli import REPO, harness, records

VOCAB = 1024  # the llama fixture's
ADAPTER = REPO / "examples" / "mlx_lm_adapter.py"
CELL = ["arch=llama", "arch.dtype=float32", "bench=smoke", "bench.max_prompts=1", "bench.max_new_tokens=16",
        "bench.reps=2", "bench.profile=false"]

# One fake engine, its behaviour picked by argv[1]: each request answered with max_new_tokens
# token lines unless the mode says otherwise.
ENGINE = """
import json, sys, time
mode = sys.argv[1]
print(json.dumps({"type": "ready", "implementation": "fake-" + mode}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    n = req["max_new_tokens"]
    if mode == "stops_short":  # 5 tokens and done, no stop token among them
        n = 5
    if mode == "ends_at_stop":  # 3 tokens, the last a stop id it was sent
        n = 3
    for i in range(n):
        token = req["stop_ids"][0] if mode == "ends_at_stop" and i == n - 1 else 5 + i
        extra = {"drafted": 3, "accepted": 3} if mode == "claims_drafts" else {}
        print(json.dumps({"id": req["id"], "tokens": [token], **extra}), flush=True)
        if mode == "late_done":
            time.sleep(0.02)
    if mode == "late_done":
        time.sleep(0.5)
    print(json.dumps({"id": req["id"], "done": True}), flush=True)
"""


@pytest.fixture(scope="module")
def engine_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("footing") / "engine.py"
    path.write_text(textwrap.dedent(ENGINE))
    return path


def _arm(engine_file, mode: str) -> SubprocessArm:
    cfg = SimpleNamespace(command=f"{sys.executable} {engine_file} {mode}", startup_timeout_s=20, request_timeout_s=20)
    return SubprocessArm(SimpleNamespace(vocab_size=VOCAB), cfg)


# ---- the BLAS a child runs on ----

MKL = {"action": "loaded", "library": "/opt/blas/libmkl_rt.so.3", "kind": "mkl", "needs": ["/opt/blas/libtbb.so.12"],
       "env_set": {"MKL_THREADING_LAYER": "TBB", "MKL_INTERFACE_LAYER": "GNU,LP64"}, "reason": "test"}


def test_a_child_is_given_the_harness_blas_after_the_users_preload_and_the_users_settings_win():
    env = blas.child_env({"LD_PRELOAD": "/u/libhook.so", "MKL_THREADING_LAYER": "GNU", "PATH": "/bin"}, MKL)
    assert env["LD_PRELOAD"] == "/u/libhook.so:/opt/blas/libtbb.so.12:/opt/blas/libmkl_rt.so.3"  # needs first
    assert env["MKL_THREADING_LAYER"] == "GNU" and env["MKL_INTERFACE_LAYER"] == "GNU,LP64" and env["PATH"] == "/bin"
    again = blas.child_env(env, {**MKL, "action": "kept", "needs": []})  # already preloaded: not twice
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"]
    reference = {"action": "skipped", "library": None, "kind": None, "needs": [], "env_set": {}, "reason": "test"}
    assert blas.child_env({"PATH": "/bin"}, reference) == {"PATH": "/bin"}  # the wheel's BLAS here: nothing to give


def _mkl_selection() -> dict:
    cand = next((c for c in blas.candidates() if c.kind == "mkl" and all(map(os.path.exists, (c.path, *c.needs)))),
                None)
    if cand is None:
        pytest.skip("no MKL here (pip install mkl)")
    return {**MKL, "library": cand.path, "needs": list(cand.needs), "env_set": dict(cand.env)}


def test_the_adapter_started_by_the_harness_runs_on_the_harness_blas_and_says_so(monkeypatch):
    """The harness on MKL (a selection as select() makes it; nothing is loaded into this process):
    the adapter, started as an arm, multiplies on MKL too (was: the wheel's reference BLAS, 0.381x
    base). And a child on another BLAS than the harness's is one warning line with the fix."""
    from harness.run import _outside_footing

    monkeypatch.setattr(blas, "_SELECTION", _mkl_selection())
    monkeypatch.setattr(outside, "FOOTING", outside.FOOTING)  # restored after the test
    _outside_footing()  # what the harness tells engines/arms/outside.py before it builds an arm
    cfg = SimpleNamespace(command=f"{sys.executable} {ADAPTER} --model {fixture_dir('llama')}", startup_timeout_s=60,
                          request_timeout_s=60)
    arm = SubprocessArm(SimpleNamespace(vocab_size=VOCAB), cfg)
    try:
        footing = arm.describe()["blas"]
        warnings = arm.describe()["warnings"]
    finally:
        arm.close()
    assert footing["reported_kind"] == "mkl" and footing["given"]["preload"][-1] == blas.selection()["library"]
    assert os.path.realpath(footing["reported"]) == os.path.realpath(blas.selection()["library"])
    # this test process runs on the wheel's reference BLAS (tests/conftest.py), so here the child is the odd one
    assert footing["harness_kind"] == "reference"
    (line,) = warnings
    assert "runs on the mkl BLAS" in line and "the harness on the reference BLAS" in line and "Fix:" in line


def test_a_cell_of_the_adapter_against_mlx_lm_names_the_same_blas_for_both_arms(tmp_path):
    cmd = f"{sys.executable} {ADAPTER} --model {fixture_dir('llama')} --dtype float32"
    r = harness("method=subprocess", f"method.command='{cmd}'", "reference=mlx_lm", *CELL, f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "ok", rec.get("reason")
    footing, env = rec["engine"]["blas"], rec["env"]
    assert env["blas_selection"]["requested"] == "reference"  # the suite's choice (tests/conftest.py)
    assert footing["harness"] == env["blas"] and footing["harness_kind"] == env["blas_kind"] == "reference"
    assert os.path.realpath(footing["reported"]) == os.path.realpath(env["blas"])  # the child: the same library
    assert footing["given"] == blas.child_blas(env["blas_selection"])  # given what the harness chose (nothing more)
    assert rec["engine"]["warnings"] == [] and rec["summary"]["diverged_prompts"] == 0
    assert all(len(p["tail_s"]) == 2 and len(p["base"]["tail_s"]) == 2 for p in rec["prompts"])


# ---- decode time ends at the last token ----

def test_a_late_done_line_is_kept_as_a_tail_not_timed_as_decoding(engine_file):
    """Tokens 20 ms apart, then `done` 0.5 s later: decode time ends at the last token (was: at
    `done`, 12.9 tok/s against 17.9 from the tokens' arrivals), the 0.5 s is the tail, warned about."""
    arm = _arm(engine_file, "late_done")
    try:
        gen = run_generation(arm, [1, 2, 3], 8, Sampler())
        warnings = arm.describe().get("warnings")
    finally:
        arm.close()
    assert gen.tokens == list(range(5, 13))
    assert gen.decode_s < 0.3 and gen.decode_tps > 7 / 0.3, gen.decode_s  # 7 tokens after the first, 20 ms apart
    assert gen.tail_s >= 0.45, gen.tail_s
    (line,) = warnings
    assert "wrote its `done` line 0.5" in line and "Fix:" in line


class _Forever(BaseHTTPRequestHandler):
    """A server that streams a one-token piece every 50 ms (20 tok/s) and never ends the stream."""

    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"data: " + json.dumps({"choices": [{"text": " the"}]}).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:  # the arm closed the stream
            pass


def test_a_stream_that_goes_on_forever_is_timed_to_its_last_token_and_warned_about(monkeypatch):
    from harness.models.load import load_target

    monkeypatch.setattr(outside, "TAIL_S", 1.0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Forever)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = SimpleNamespace(url=f"http://127.0.0.1:{server.server_address[1]}", model=None, launch=None,
                          startup_timeout_s=5, request_timeout_s=30)
    try:
        arm = ServerArm(SimpleNamespace(vocab_size=VOCAB), cfg)
        arm.tokenizer = load_target(fixture_dir("llama"), "float32")[1]
        gen = run_generation(arm, [1, 2, 3], 8, Sampler())
        warnings = arm.describe().get("warnings")
    finally:
        server.shutdown()
    assert len(gen.tokens) == 8 and 12 < gen.decode_tps < 28, gen.decode_tps  # ~20 tok/s (was: 4.0)
    assert gen.tail_s >= 0.9, gen.tail_s
    (line,) = warnings
    assert f"server at {cfg.url} kept its stream open" in line and "Fix:" in line


# ---- counts and short outputs ----

def test_counts_that_contradict_the_tokens_are_an_error_naming_the_engine_and_the_values(engine_file):
    arm = _arm(engine_file, "claims_drafts")
    try:
        with pytest.raises(ArmReportError, match=r"subprocess engine .*fake-claims_drafts.* emitted 1 token\(s\) in "
                                                  r"step 1, which reported accepted=3"):
            run_generation(arm, [1, 2, 3], 8, Sampler())
    finally:
        arm.close()


def test_an_output_that_ends_at_a_stop_id_before_the_budget_is_complete(engine_file):
    arm = _arm(engine_file, "ends_at_stop")
    try:
        gen = run_generation(arm, [1, 2, 3], 8, Sampler(), stop_tokens=frozenset({9}))
    finally:
        arm.close()
    assert gen.tokens == [5, 6, 9]


@pytest.mark.parametrize("mode, said", [
    ("claims_drafts", "emitted 1 token(s) in step 1, which reported accepted=3"),
    ("stops_short", "ended after 5 of max_new_tokens=16 tokens without a stop token"),
])
def test_a_lying_or_short_engine_is_an_error_record_and_exit_3(tmp_path, engine_file, mode, said):
    r = harness("method=subprocess", f"method.command='{sys.executable} {engine_file} {mode}'", *CELL,
                "bench.reps=1", f"out_dir={tmp_path}")
    assert r.returncode == 3, r.stderr[-2000:]
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "error" and said in rec["reason"] and f"fake-{mode}" in rec["reason"], rec["reason"]
