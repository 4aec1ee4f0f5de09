"""A seeded, time-bounded fuzz of what outside engines say: the subprocess protocol's JSON
lines and a server's event stream, mutated (ids, counts, line and chunk boundaries, shapes,
endings). Every case must end either in the arm's own error (OutsideError or ArmReportError:
an `error` record naming the arm) or in tokens equal to what was sent (the subprocess's ids;
the re-encoding of the server's whole text) -- never another exception, never a hang.
Mutations that are invalid whatever the implementation must end in the error."""

from __future__ import annotations

import json
import random
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from engines.arms import outside
from engines.arms.external import ArmReportError
from engines.arms.outside import OutsideError, ServerArm, SubprocessArm
from engines.base import Prefill
from engines.runtime.sampling import Sampler
from harness.models.fixtures import fixture_dir

SEED = 20261204
VOCAB = 1024  # the llama fixture's
CASE_LIMIT_S = 6.0
REQUEST_TIMEOUT_S = 1.5

ENGINE = """
import json, sys
script = json.load(open(sys.argv[1]))
print(json.dumps({"type": "ready"}), flush=True)
sys.stdin.readline()  # the request (id 1: a fresh arm's first)
for kind, x in script:
    if kind == "w":
        sys.stdout.write(x)
        sys.stdout.flush()
    else:
        sys.exit(x)
sys.stdin.read()  # alive and silent until the arm closes it: the arm's deadline must end any wait
"""


def _outcome(arm, max_new: int):
    """('error', message) or ('ok', tokens) of one generation; anything else propagates."""
    t0 = time.monotonic()
    try:
        events = list(arm.generate([1, 2, 3], max_new, Sampler(), frozenset()))
    except (OutsideError, ArmReportError) as e:
        return "error", str(e), time.monotonic() - t0
    assert isinstance(events[0], Prefill)
    return "ok", [events[0].token] + [t for ev in events[1:] for t in ev.emitted], time.monotonic() - t0


# ---- the subprocess protocol ----

def _line(tokens, rng, counts=True) -> dict:
    line = {"id": 1, "tokens": tokens}
    if counts and rng.random() < 0.5:
        line.update(drafted=len(tokens) - 1 + rng.randint(0, 2), accepted=len(tokens) - 1)
    return line


BAD_TOKENS = [[VOCAB], [-1], [1.5], ["7"], [True], [[1]], [], None, "5", 5, [2 ** 70]]
BAD_COUNTS = [{"drafted": 1, "accepted": 2}, {"drafted": -1, "accepted": -1}, {"drafted": 1.5, "accepted": 0},
              {"drafted": "2", "accepted": 1}, {"drafted": True, "accepted": True}, {"drafted": 0, "accepted": -1}]
GARBAGE = ["tokens: 1 2", "[1, 2]", "{", "null", '"text"', "\x00\x01"]


def subprocess_case(rng: random.Random):
    """(mutation, script lines, tokens sent, max_new_tokens, expect 'ok' | 'error' | 'either')."""
    sent = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 10))]
    max_new = rng.randint(max(1, len(sent) - 3), len(sent))
    lines, i = [], 0
    while i < len(sent):
        n = rng.randint(1, 3)
        lines.append(_line(sent[i:i + n], rng))
        i += n
    done = {"id": 1, "done": True}
    kind = rng.choice(["clean", "split_writes", "extra_keys", "crlf", "id_wrong", "tokens_bad", "counts_bad",
                       "too_many", "garbage", "newline_inside", "error_line", "exit_mid", "done_first", "no_done"])
    expect, k = "error", rng.randrange(len(lines))
    cut = sum(len(x["tokens"]) for x in lines[:k]) < max_new  # line k is read before the budget is spent
    if kind in ("clean", "split_writes", "extra_keys", "crlf"):
        expect = "ok"
        if kind == "extra_keys":
            lines[k]["note"] = {"anything": [1, 2]}
    elif kind == "id_wrong":
        lines[k]["id"] = rng.choice([7777, "x", None, [1]])
    elif kind == "tokens_bad":
        lines[k]["tokens"] = rng.choice(BAD_TOKENS)
    elif kind == "counts_bad":
        lines[k].update(rng.choice(BAD_COUNTS))
    elif kind == "too_many":  # a later line of 3 tokens claims its step accepted nothing
        ks = [j for j in range(1, len(lines)) if len(lines[j]["tokens"]) >= 3]
        k = rng.choice(ks) if ks else k
        left = max_new - sum(len(x["tokens"]) for x in lines[:k])  # the budget cuts the line to this
        lines[k].update(drafted=0, accepted=0)
        expect = "error" if ks and left >= 2 else "either"
        cut = True
    elif kind == "error_line":
        lines[k] = {"id": 1, "error": "out of memory"}
    elif kind == "done_first":
        lines.insert(0, done)
        k, cut = 0, True
    raw = [json.dumps(x) + "\n" for x in lines] + ([] if kind == "no_done" else [json.dumps(done) + "\n"])
    if kind == "garbage":
        raw[k] = rng.choice(GARBAGE) + "\n"
    elif kind == "newline_inside":
        half = len(raw[k]) // 2
        raw[k] = raw[k][:half] + "\n" + raw[k][half:]
    elif kind == "crlf":
        raw = [r[:-1] + "\r\n" for r in raw]
    if not cut and kind not in ("no_done", "exit_mid"):
        expect = "ok"  # the arm stops at the budget and drains to the done line unharmed...
        if kind in ("garbage", "newline_inside", "id_wrong", "error_line"):
            expect = "either"  # ...or reads the broken line while draining
    script = []
    for r in raw:  # a line written in pieces must read as one
        if kind == "split_writes" and len(r) > 4:
            a = rng.randint(1, len(r) - 2)
            script += [["w", r[:a]], ["w", r[a:]]]
        else:
            script.append(["w", r])
    if kind == "exit_mid":
        script.insert(min(k, len(script)), ["exit", 5])
    return kind, script, sent, max_new, expect


@pytest.fixture(scope="module")
def engine_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "engine.py"
    path.write_text(textwrap.dedent(ENGINE))
    return path


def test_the_subprocess_protocol_under_mutation_ends_in_its_error_or_the_tokens_sent(engine_file, tmp_path):
    rng, seen = random.Random(SEED), {}
    t_all = time.monotonic()
    for case in range(70):
        kind, script, sent, max_new, expect = subprocess_case(rng)
        path = tmp_path / f"case{case}.json"
        path.write_text(json.dumps(script))
        cfg = SimpleNamespace(command=f"{sys.executable} {engine_file} {path}", startup_timeout_s=10,
                              request_timeout_s=REQUEST_TIMEOUT_S)
        arm = SubprocessArm(SimpleNamespace(vocab_size=VOCAB), cfg)
        try:
            got, value, seconds = _outcome(arm, max_new)
        finally:
            arm.close()
        where = f"case {case} ({kind}, expect {expect}): {got} {value!r}"
        assert seconds < CASE_LIMIT_S, where
        if got == "ok":
            assert value == sent[:max_new], where
        assert expect in (got, "either"), where
        if got == "error":
            assert "engine" in value or "subprocess" in value, where  # the record names the arm
        seen[kind] = seen.get(kind, 0) + 1
    assert len(seen) >= 12, seen  # the seed reaches nearly every mutation
    assert time.monotonic() - t_all < 60


# ---- the server's event stream ----

PIECES = ["Hello", " world", ",", " the", " caf", "é", " 漢字", " 🙂", "\n", " def", " f", "(x", "):", " return",
          " x", " +", " 1", " a", "b", "c", "  ", "\t"]


class Fake:
    """What the fake server sends next: a list of (bytes, then sleep seconds), or an HTTP status."""
    script: list = []
    status = 200


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(Fake.status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            for data, pause in Fake.script:
                self.wfile.write(data)
                self.wfile.flush()
                if pause:
                    time.sleep(pause)
        except OSError:  # the arm closed the stream: done with this case
            pass
        self.close_connection = True


def _event(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


BAD_CHUNKS = [b"{not json", b"[1, 2]", b"42", b'"text"', {"choices": "abc"}, {"choices": 5}, {"choices": {"text": "x"}},
              {"choices": [5]}, {"choices": [{"text": 5}]}, {"choices": [], "usage": "many"},
              {"choices": [], "usage": {"prompt_tokens": "7"}}, {"choices": [], "usage": {"prompt_tokens": -1}},
              {"choices": [], "timings": {"draft_n": "3"}}, {"choices": [], "timings": [1]}]


def server_case(rng: random.Random, tok):
    """(mutation, script, text sent, max_new_tokens, expect)."""
    pieces = [rng.choice(PIECES) for _ in range(rng.randint(3, 12))]
    text = "".join(pieces)
    n_ids = len(tok.encode(text, add_special_tokens=False))
    max_new = rng.randint(max(1, n_ids - 3), n_ids + 2)
    events = [_event({"choices": [{"text": p}]}) for p in pieces]
    tail = [_event({"choices": [], "usage": {"prompt_tokens": 3}}), _event(b"[DONE]")]
    kind = rng.choice(["clean", "byte_slices", "crlf", "comments", "empty_events", "after_done", "bad_chunk",
                       "http_500", "closed_early", "cut_mid_line", "no_text", "open_after_tokens"])
    expect, status = "ok", 200
    if kind == "crlf":
        events = [e.replace(b"\n", b"\r\n") for e in events]
    elif kind == "comments":
        events = [b": keep-alive\n\nevent: message\n" + e for e in events]
    elif kind == "empty_events":
        events = [e + _event({"choices": []}) + _event({"choices": [{"text": ""}]}) for e in events]
    elif kind == "after_done":
        tail.append(_event(b"{garbage after the end"))
    elif kind == "bad_chunk":
        at = rng.randrange(len(events) + 1)  # also after the last token, where only totals arrive
        events.insert(at, _event(rng.choice(BAD_CHUNKS)))
        expect = "error"
    elif kind == "http_500":
        status, expect = 500, "error"
    elif kind == "closed_early":
        tail, expect = [], "error"
    elif kind == "cut_mid_line":
        tail, expect = [_event({"choices": [{"text": "x"}]})[:9]], "error"
    elif kind == "no_text":
        events, expect = [], "error"
    elif kind == "open_after_tokens":  # neither [DONE] nor a closed stream: fine once every token is in
        tail = [(b"", 20.0)]
        expect = "ok" if max_new <= n_ids else "error"
    stream = b"".join(events) + b"".join(x for x in tail if isinstance(x, bytes))
    if kind == "byte_slices":  # chunk boundaries anywhere, inside UTF-8 characters too
        cuts = sorted(rng.sample(range(1, len(stream)), min(12, len(stream) - 1)))
        script = [(stream[a:b], rng.choice([0, 0, 0.002])) for a, b in zip([0, *cuts], [*cuts, len(stream)])]
    else:
        script = [(stream, 0)] + [x for x in tail if isinstance(x, tuple)]
    return kind, script, status, text, max_new, expect


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_server_stream_under_mutation_ends_in_its_error_or_the_text_sent(fake_server, monkeypatch):
    from harness.models.load import load_target

    monkeypatch.setattr(outside, "TAIL_S", 0.3)  # how long a finished stream may stay open, shortened
    _, tok = load_target(fixture_dir("llama"), "float32")
    rng, seen = random.Random(SEED), {}
    t_all = time.monotonic()
    for case in range(120):
        kind, Fake.script, Fake.status, text, max_new, expect = server_case(rng, tok)
        cfg = SimpleNamespace(url=fake_server, model=None, launch=None, startup_timeout_s=5,
                              request_timeout_s=REQUEST_TIMEOUT_S)
        arm = ServerArm(SimpleNamespace(vocab_size=VOCAB), cfg)
        arm.tokenizer = tok
        got, value, seconds = _outcome(arm, max_new)
        where = f"case {case} ({kind}, expect {expect}): {got} {value!r} for {text!r}"
        assert seconds < CASE_LIMIT_S, where
        if got == "ok":
            assert value == tok.encode(text, add_special_tokens=False)[:max_new], where
        assert expect in (got, "either"), where
        if got == "error":
            assert "server at" in value, where
        seen[kind] = seen.get(kind, 0) + 1
    assert len(seen) == 12, seen
    assert time.monotonic() - t_all < 60
