"""Engines outside this process as arms: anything that speaks the harness's subprocess protocol
(`method=subprocess`), e.g. a CLI engine such as hf2q behind a small adapter.

The protocol is JSON lines over the engine's stdin/stdout (stderr is its log, kept):

    engine -> {"type": "ready", "implementation": "...", "version": "...",
               "blas": "/path/to/the/library/serving/cblas_sgemm"}               once, at start (blas optional)
    harness -> {"type": "generate", "id": 1, "prompt_ids": [...], "max_new_tokens": 64,
                "temperature": 0.0, "seed": 0, "stop_ids": [...]}
    engine -> {"id": 1, "tokens": [...], "drafted": 3, "accepted": 2}        per token or per round
    engine -> {"id": 1, "done": true}                                          after the last token
    engine -> {"id": 1, "error": "..."}                                        instead, on failure

`drafted` / `accepted` are optional: without them a line's tokens count as one round that
drafted and accepted all but one of them, and the record says acceptance was inferred.
Times are the harness's own clock at each line's arrival (a reader thread stamps them), so
the arm is timed as the harness's arms are: first token, then tokens after it over the time
after it; decode time ends at the last token's arrival, and how long the reply went on after
it (a late `done`) is kept and warned about when long. Any failure (the engine will not start,
dies, writes a malformed line, stalls past method.request_timeout_s, a bound on the whole
request) raises OutsideError naming it, and the cell is an `error` record.

Every process the harness starts here runs on the harness's BLAS: harness.blas loaded it with
dlopen, which a child does not inherit, so it is preloaded for the child (blas.child_env). The
record says what the harness runs on, what the child was given and, where the engine says so
(the ready line's `blas`), what it runs on; another library than the harness's is a warning.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Callable

from engines.arms.external import External, stamped_events
from engines.errors import Unsupported
from engines.home import home

STDERR_TAIL = 40  # lines of the engine's log quoted in an error
TAIL_S = 5.0  # how long a stream may run on past its last needed token (for its closing usage/timings chunk)
# A reply that goes on after its last token for longer than this share of its decode time (and
# LONG_TAIL_MIN_S) is warned about: tok/s ends at the last token, but each request waits it out.
LONG_TAIL_SHARE, LONG_TAIL_MIN_S = 0.25, 0.05


class OutsideError(RuntimeError):
    """An outside engine failed; the message names how and quotes its log."""


def json_object(text: str, malformed: str) -> dict:
    """The JSON object `text` holds; OutsideError starting with `malformed` when it holds none."""
    try:
        message = json.loads(text)
    except json.JSONDecodeError:
        raise OutsideError(f"{malformed} {text.strip()[:200]!r} (not JSON)") from None
    if not isinstance(message, dict):
        raise OutsideError(f"{malformed} {text.strip()[:200]!r} (not a JSON object)")
    return message


@dataclass
class Footing:
    """What this process computes on, and what a child it starts is given to compute on the same:
    the harness sets FOOTING from harness/blas.py before it builds an outside arm (engines import
    nothing from the harness). Unset, a child gets this process's environment as it is, and the
    record says nothing was given."""

    environ: Callable[[], dict] = lambda: dict(os.environ)  # a child's environment (LD_PRELOAD added)
    given: dict = field(default_factory=lambda: {"library": None, "kind": None, "preload": [], "env_set": {}})
    library: str | None = None  # the BLAS serving this process's cblas_sgemm (None on GPU backends)
    kind_of: Callable[[str], str | None] = lambda path: None  # a library path -> openblas | mkl | reference ...
    chosen: str = ""  # why this process runs on `library` (harness.blas.selection()'s reason)
    fix: str = ""  # how to get an optimized BLAS


FOOTING = Footing()


class Child:
    """A process the harness started: its log (stderr, and stdout unless the caller reads it)
    kept in a file, the end of it quoted in errors; stopped by close()."""

    def __init__(self, command: str, log_path: Path, read_stdout: bool = False):
        self.command, self.log_path = command, Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 -- closed in close()
        self.blas_given = FOOTING.given  # the harness's BLAS, preloaded for it (module docstring)
        try:
            self.proc = subprocess.Popen(shlex.split(command), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE if read_stdout else self._log,
                                         stderr=subprocess.PIPE, text=True, bufsize=1, env=FOOTING.environ())
        except OSError as e:
            self._log.close()
            raise OutsideError(f"could not start `{command}`: {e}") from None
        self.tail: deque = deque(maxlen=STDERR_TAIL)
        self._stderr = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr.start()

    def _read_stderr(self):
        for line in self.proc.stderr:
            self._log.write(line)
            self._log.flush()
            self.tail.append(line.rstrip("\n"))

    def who(self) -> str:
        return f"`{self.command}`"

    def log_tail(self) -> str:
        if self.proc.poll() is not None:  # it has exited: its last lines may still be in the reader's hands
            self._stderr.join(timeout=2)
        return ("; its log ends: " + " | ".join(list(self.tail)[-8:])) if self.tail else ""

    def close(self, kill: bool = False) -> None:
        """Stop it: EOF on its stdin (the subprocess protocol's end) or SIGTERM, killed if it lingers
        10 s, or at once with kill."""
        if self.proc.poll() is None and not kill:
            try:
                self.proc.stdin.close()
                if self.proc.stdout is None:  # its stdout goes to the log: a server, which does not end at EOF
                    self.proc.terminate()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class Process(Child):
    """An engine speaking the subprocess protocol: lines out of stdout stamped on arrival."""

    def __init__(self, command: str, log_path: Path, startup_timeout_s: float):
        super().__init__(command, log_path, read_stdout=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        try:
            self.hello = self.receive(startup_timeout_s, "to start (no ready line)")
            if self.hello.get("type") != "ready":
                raise OutsideError(f"{self.who()} wrote {self.hello!r} before its ready line; the protocol starts "
                                   'with {"type": "ready", ...}')
        except BaseException:
            self.close(kill=True)  # a failed start leaves no process behind
            raise

    def _read_stdout(self):
        for line in self.proc.stdout:
            self.lines.put((time.perf_counter(), line))
        self.lines.put((time.perf_counter(), None))  # EOF: the process closed stdout or died

    def who(self) -> str:
        return f"engine `{self.command}`"

    def send(self, message: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise OutsideError(f"{self.who()} is not reading requests (exit code {self.proc.poll()})"
                               f"{self.log_tail()}") from None

    def receive_stamped(self, timeout_s: float, waiting_for: str, until: float | None = None) -> tuple[float, dict]:
        """(arrival time, message) of the next line; OutsideError on EOF, timeout or bad JSON.
        `until` (time.monotonic) bounds the whole operation the line belongs to, `timeout_s` its length."""
        wait = timeout_s if until is None else max(until - time.monotonic(), 1e-3)
        try:
            t, line = self.lines.get(timeout=wait)
        except queue.Empty:
            raise OutsideError(f"{self.who()} took longer than {timeout_s:g} s {waiting_for}{self.log_tail()}") from None
        if line is None:
            code = self.proc.wait(timeout=10)
            raise OutsideError(f"{self.who()} exited with code {code} while the harness waited for it "
                               f"{waiting_for}{self.log_tail()}")
        return t, json_object(line, f"{self.who()} wrote a malformed line")

    def receive(self, timeout_s: float, waiting_for: str, until: float | None = None) -> dict:
        return self.receive_stamped(timeout_s, waiting_for, until)[1]


def log_path(kind: str) -> Path:
    return home() / "outside-logs" / f"{kind}-{os.getpid()}-{time.time_ns()}.log"


def blas_footing(who: str, child: Child | None, reported: str | None) -> tuple[dict, list[str]]:
    """The record's `blas` for an outside arm (what the harness runs on, what the child was given,
    what it says it runs on) and a one-line warning, with the fix, when that is another library."""
    ours = FOOTING.library  # None on GPU backends: the CPU BLAS does not time them
    out = {"harness": ours, "harness_kind": FOOTING.kind_of(ours) if ours else None,
           "given": child.blas_given if child else "nothing: the harness did not start it",
           "reported": reported, "reported_kind": FOOTING.kind_of(reported) if reported else None}
    if not (ours and reported) or os.path.realpath(ours) == os.path.realpath(reported):
        return out, []
    given = (child.blas_given if child else {}).get("preload")
    fix = (f"it was given LD_PRELOAD={':'.join(given)}; an engine that clears LD_PRELOAD or links a BLAS of its "
           f"own must load {given[-1]} itself" if given else
           f"the harness runs on {ours} ({FOOTING.chosen}): {FOOTING.fix}, or start the engine on the "
           "same library")
    return out, [f"{who} runs on the {out['reported_kind']} BLAS {reported}, the harness on the {out['harness_kind']} "
                 f"BLAS {ours}: its times are not on the footing of the harness's arms. Fix: {fix}"]


def tail_footing(who: str, tails: list[tuple[float, float]], what: str, fix: str) -> tuple[dict, list[str]]:
    """The record's `tail_s` for an outside arm, from (seconds its reply went on after its last
    token, its decode seconds) per request, and a one-line warning when the tail is long."""
    if not tails:
        return {"requests": 0}, []
    after, decode = sorted(a for a, _ in tails), sorted(d for _, d in tails)
    median, median_decode = after[len(after) // 2], decode[len(decode) // 2]
    out = {"median": round(median, 6), "max": round(after[-1], 6), "requests": len(tails),
           "decode_s_median": round(median_decode, 6)}
    if median < max(LONG_TAIL_MIN_S, LONG_TAIL_SHARE * median_decode):
        return out, []
    return out, [f"{who} {what} {median:.2f} s after its last token (median of {len(tails)} requests; max "
                 f"{after[-1]:.2f} s; its decode time {median_decode:.2f} s): tok/s ends at the last token, so it is "
                 f"not affected, but every request waits it out. Fix: {fix}"]


class SubprocessArm(External):
    """An engine process speaking the subprocess protocol (module docstring)."""

    name = "subprocess"
    knobs = ("command", "startup_timeout_s", "request_timeout_s")

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        if not getattr(cfg, "command", None):
            raise Unsupported("method=subprocess needs method.command=<the engine's command line>, e.g. "
                              "'python examples/mlx_lm_adapter.py --model <dir>'")
        self.proc = Process(cfg.command, log_path("subprocess"), cfg.startup_timeout_s)
        self.timeout_s, self.requests, self.reported = cfg.request_timeout_s, 0, True
        self.tails: list[tuple[float, float]] = []  # (seconds from the last token to `done`, decode seconds)
        if not isinstance(self.proc.hello.get("blas", ""), str):
            self.proc.close(kill=True)
            raise OutsideError(f"{self.who()} wrote a ready line whose `blas` is {self.proc.hello['blas']!r}: it "
                               "must be the path (or name) of the library serving cblas_sgemm, or be left out")

    def who(self) -> str:
        impl = self.proc.hello.get("implementation")
        return f"subprocess {self.proc.who()}" + (f" ({impl})" if impl else "")

    def generate(self, prompt, max_new_tokens, sampler, stop_tokens):
        t0 = time.perf_counter()
        yield from stamped_events(self._lines(prompt, max_new_tokens, sampler, stop_tokens), t0, self)

    def _lines(self, prompt, max_new_tokens, sampler, stop_tokens):
        # (arrival time, tokens, drafted, accepted, None) per token line of one request
        self.requests += 1
        rid = self.requests
        self.proc.send({"type": "generate", "id": rid, "prompt_ids": list(map(int, prompt)),
                        "max_new_tokens": max_new_tokens, "temperature": sampler.temperature, "seed": sampler.seed,
                        "stop_ids": sorted(stop_tokens)})
        n, until = 0, time.monotonic() + self.timeout_s  # method.request_timeout_s bounds the whole request
        arrived = []  # the token lines' arrival times
        while True:
            t, m = self.proc.receive_stamped(self.timeout_s, f"to finish request {rid}", until)
            if m.get("id") != rid:
                raise OutsideError(f"engine answered request {m.get('id')!r} while request {rid} was open: {m!r}")
            if "error" in m:
                raise OutsideError(f"engine reported an error on request {rid}: {m['error']}")
            if m.get("done"):
                break
            tokens = m.get("tokens")
            if not isinstance(tokens, list) or not tokens or not all(isinstance(x, int) for x in tokens):
                raise OutsideError(f"engine line {m!r} has no token ids (`tokens`: a non-empty list of ints)")
            tokens = _cut(tokens, max_new_tokens - n, stop_tokens)
            n += len(tokens)
            drafted, accepted = m.get("drafted"), m.get("accepted")
            if drafted is None or accepted is None:
                self.reported = False
                drafted = accepted = len(tokens) - 1
            arrived.append(t)
            yield t, tokens, drafted, accepted, None
            if n >= max_new_tokens or tokens[-1] in stop_tokens:
                break
        if n == 0:
            raise OutsideError(f"engine finished request {rid} without a token")
        while not m.get("done"):  # drain to the done line so the next request starts clean
            t, m = self.proc.receive_stamped(self.timeout_s, f"to finish request {rid}", until)
        self.tails.append((t - arrived[-1], arrived[-1] - arrived[0]))

    def close(self) -> None:
        self.proc.close()

    def describe(self):
        h = self.proc.hello
        footing, blas_warnings = blas_footing(self.who(), self.proc, h.get("blas"))
        tail, tail_warnings = tail_footing(self.who(), self.tails, "wrote its `done` line",
                                           "write `done` right after the last token (finish other work before it)")
        return {"implementation": h.get("implementation", "?"), "version": h.get("version"),
                "acceptance_observed": self.reported, "command": self.proc.command, "log": str(self.proc.log_path), "protocol": "subprocess JSON lines",
                "observed": "token ids and arrival times per line; drafted/accepted "
                            + ("as the engine reported them" if self.reported else "inferred from tokens per line "
                               "(the engine reported none)") + "; no logits, so divergence margins are unavailable",
                "blas": footing, "tail_s": tail, "warnings": blas_warnings + tail_warnings}


def _cut(tokens: list[int], room: int, stop_tokens: frozenset[int]) -> list[int]:
    """The tokens a line adds to the output: at most `room` (an engine that overshoots the budget is
    cut, as every arm is), and none after the first stop token (the harness's loop ends there)."""
    tokens = tokens[:room]
    stop = next((i for i, x in enumerate(tokens) if x in stop_tokens), None)
    return tokens if stop is None else tokens[: stop + 1]


def _count(x) -> bool:
    """Whether a server-reported count is one: a non-negative integer, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _listening(url: str) -> bool:
    """Whether a process already accepts connections at url's host and port."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout=1):
            return True
    except OSError:
        return False


class ServerArm(External):
    """An OpenAI-compatible server (mlx_lm.server, llama.cpp's llama-server, vLLM, your own)
    streamed over /v1/completions: the prompt ids are sent as their text (chat template
    already applied, so no server-side template changes them), the streamed text is
    re-encoded with the target's tokenizer into ids (the record says so), and each chunk's
    arrival time times it. method.launch starts the server for the cell (health-checked on
    /health or /v1/models, stopped after, its log kept); without it, method.url must answer."""

    name = "server"
    knobs = ("url", "model", "launch", "startup_timeout_s", "request_timeout_s")

    def __init__(self, target, cfg):
        super().__init__(target, cfg)
        if not getattr(cfg, "url", None):
            raise Unsupported("method=server needs method.url=http://host:port (and method.launch=<command> to "
                              "have the harness start the server)")
        self.url, self.timeout_s = cfg.url.rstrip("/"), cfg.request_timeout_s
        self.model = cfg.model  # None: the request names no model, so the server uses the one it loaded
        if cfg.launch and _listening(self.url):
            # The launched server could not bind, and the old one would answer /health and every request.
            raise OutsideError(f"method.launch would start a server for {self.url}, where another process already "
                               "listens: stop it, or give the launched server another port (in method.url too)")
        self.child = Child(cfg.launch, log_path("server")) if cfg.launch else None
        self.reported: dict = {}  # what the server said about its drafting (llama.cpp's timings)
        self.tails: list[tuple[float, float]] = []  # (seconds from the last needed chunk to the stream's end, decode s)
        self.prompt_tokens_seen: list[tuple[int, int]] = []  # (server's prompt token count, ours)
        try:
            self.health = self._wait_healthy(cfg.startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def who(self) -> str:
        return f"server at {self.url}"

    def _wait_healthy(self, timeout_s: float) -> str:
        path = self._poll_health(timeout_s)
        time.sleep(0.2 if self.child else 0)  # a launched server that answered must still be the one running
        if self.child and self.child.proc.poll() is not None:
            raise OutsideError(f"server {self.child.who()} exited with code {self.child.proc.returncode} although "
                               f"{self.url} answered: another process answers there{self.child.log_tail()}")
        return path

    def _poll_health(self, timeout_s: float) -> str:
        import urllib.error
        import urllib.request

        deadline, last = time.monotonic() + timeout_s, "no answer"
        while time.monotonic() < deadline:
            if self.child and self.child.proc.poll() is not None:
                raise OutsideError(f"server {self.child.who()} exited with code {self.child.proc.returncode} before "
                                   f"answering {self.url}{self.child.log_tail()}")
            for path in ("/health", "/v1/models"):
                try:
                    with urllib.request.urlopen(self.url + path, timeout=5) as r:
                        if r.status == 200:
                            return path
                        last = f"{path}: HTTP {r.status}"
                except urllib.error.HTTPError as e:
                    last = f"{path}: HTTP {e.code}"
                except (urllib.error.URLError, OSError) as e:
                    last = f"{path}: {getattr(e, 'reason', e)}"
            time.sleep(0.25)
        raise OutsideError(f"server at {self.url} was not healthy within {timeout_s:g} s ({last})"
                           + (self.child.log_tail() if self.child else ""))

    def _stream(self, body: dict):
        """(arrival time, chunk) per server-sent event of a streamed POST /v1/completions."""
        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(self.url)
        conn = (http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection)(
            u.hostname, u.port, timeout=self.timeout_s)
        try:
            conn.request("POST", (u.path or "") + "/v1/completions", json.dumps(body),
                         {"Content-Type": "application/json"})
            sock = conn.sock  # the response reads it after the connection lets go (Connection: close)
            resp = conn.getresponse()
            if resp.status != 200:
                raise OutsideError(f"server at {self.url} answered HTTP {resp.status}: {resp.read()[:300]!r}")
            while True:
                try:  # a deadline on the whole request, not on each read (a buffered line needs no wait)
                    sock.settimeout(max(self.until - time.monotonic(), 1e-3))
                    line = resp.readline()
                except TimeoutError:
                    if self.tokens_done:  # every token is in hand: a stream that does not end costs no more
                        return
                    raise OutsideError(f"server at {self.url} did not finish a request within method.request_timeout_s="
                                       f"{self.timeout_s:g} s{self._died()}") from None
                t = time.perf_counter()
                if not line:
                    raise OutsideError(f"server at {self.url} closed the stream mid-stream, before `data: [DONE]`"
                                       f"{self._died()}")
                line = line.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                yield t, json_object(payload, f"server at {self.url} sent a malformed stream chunk")
        except (OSError, http.client.HTTPException) as e:
            raise OutsideError(f"server at {self.url} failed mid-stream: {type(e).__name__}: {e}{self._died()}") from None
        finally:
            conn.close()

    def _died(self) -> str:
        """How the launched server ended, when it has (waited for briefly: a dying server drops the stream first)."""
        if not self.child:
            return ""
        try:
            code = self.child.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return ""
        time.sleep(0.1)  # its last log lines
        return f"; the server exited with code {code}{self.child.log_tail()}"

    def generate(self, prompt, max_new_tokens, sampler, stop_tokens):
        body = {"prompt": self.tokenizer.decode(list(prompt)), "max_tokens": max_new_tokens,
                "temperature": sampler.temperature, "seed": sampler.seed, "stream": True,
                "stream_options": {"include_usage": True}, **({"model": self.model} if self.model else {})}
        t0 = time.perf_counter()
        yield from stamped_events(self._chunks(body, len(prompt), max_new_tokens), t0, self)

    def _chunks(self, body: dict, prompt_len: int, max_new_tokens: int):
        # (arrival time, new ids, drafted, accepted, None) per stream chunk that completes a token
        text, arrivals, n = "", [], 0  # arrivals: (time, length of the text received by then)
        self.until, self.tokens_done = time.monotonic() + self.timeout_s, False
        for t, chunk in self._stream(body):
            piece = self._piece(chunk, prompt_len)
            if not piece or n >= max_new_tokens:
                continue
            text += piece
            arrivals.append((t, len(text)))
            n = len(self.tokenizer.encode(text, add_special_tokens=False))
            if n >= max_new_tokens:  # the rest of the stream only carries totals (usage, llama.cpp's timings)
                self.tokens_done, self.until = True, min(self.until, time.monotonic() + TAIL_S)
        if not text:
            raise OutsideError(f"server at {self.url} streamed no text for a prompt of {prompt_len} tokens")
        self.tails.append((time.perf_counter() - arrivals[-1][0], arrivals[-1][0] - arrivals[0][0]))
        yield from self._aligned(text, arrivals, max_new_tokens)

    def _aligned(self, text: str, arrivals: list[tuple[float, int]], max_new_tokens: int):
        """The whole text's ids, each stamped with the arrival of the chunk that completed it,
        grouped by chunk. Re-encoding chunk by chunk would emit ids that a later chunk re-merges
        (BPE joins a token's text with the next), so the record would hold ids of no text at all."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens]
        stamps, k = [], 0
        for i in range(len(ids)):
            end = len(self.tokenizer.decode(ids[:i + 1]))  # where token i ends in the text
            while k < len(arrivals) - 1 and arrivals[k][1] < end:
                k += 1
            stamps.append(arrivals[k][0])
        for t, group in groupby(zip(stamps, ids), key=itemgetter(0)):
            new = [i for _, i in group]
            yield t, new, len(new) - 1, len(new) - 1, None

    def _piece(self, chunk: dict, prompt_len: int) -> str:
        """The text a stream chunk adds; its usage and timings noted. OutsideError for a chunk of
        the wrong shape (choices not a list of objects, text not a string, counts not numbers)."""
        choices, usage, timings = chunk.get("choices") or [], chunk.get("usage") or {}, chunk.get("timings") or {}
        if not (isinstance(choices, list) and isinstance(usage, dict) and isinstance(timings, dict)):
            raise self._wrong_shape(chunk)
        texts = [c.get("text") if isinstance(c, dict) else c for c in choices]
        drafts = {k: timings.get(k) for k in ("draft_n", "draft_n_accepted")}  # llama.cpp: its speculative totals
        counts = [usage.get("prompt_tokens"), *drafts.values()]
        if not all(x is None or isinstance(x, str) for x in texts) or not all(x is None or _count(x) for x in counts):
            raise self._wrong_shape(chunk)
        if counts[0] is not None:
            self.prompt_tokens_seen.append((counts[0], prompt_len))
        for key, value in drafts.items():
            if value is not None:
                self.reported[key] = self.reported.get(key, 0) + value
        return "".join(x for x in texts if x)

    def _wrong_shape(self, chunk: dict) -> OutsideError:
        return OutsideError(f"server at {self.url} sent a stream chunk of the wrong shape: {json.dumps(chunk)[:300]}")

    def close(self) -> None:
        if self.child:
            self.child.close()

    def describe(self):
        differ = [s for s in self.prompt_tokens_seen if s[0] != s[1]]
        footing, blas_warnings = blas_footing(self.who(), self.child, None)  # a server does not say its BLAS
        tail, tail_warnings = tail_footing(
            self.who(), self.tails, "kept its stream open", "end the stream (`data: [DONE]`) after the last token "
            f"(the harness closes a stream that does not end {TAIL_S:g} s after the last token it needs)")
        return {"implementation": f"OpenAI-compatible server at {self.url}", "model": self.model,
                "acceptance_observed": False,
                "launch": self.child.command if self.child else None,
                "log": str(self.child.log_path) if self.child else None, "health": self.health,
                "protocol": "POST /v1/completions, stream", "server_reported": self.reported or None,
                "prompt_tokens_differ": len(differ), "prompt_tokens_checked": len(self.prompt_tokens_seen),
                "observed": "streamed text re-encoded with the target's tokenizer into ids (not the server's own ids); "
                            "chunk arrival times; per-round acceptance unobservable over HTTP (llama.cpp's totals "
                            "are in server_reported); no logits, so divergence margins are unavailable",
                "blas": footing, "tail_s": tail,
                "warnings": ([f"the server tokenized {len(differ)} of {len(self.prompt_tokens_seen)} prompts to another "
                              f"length than the harness's ids (first: {differ[0][0]} tokens against {differ[0][1]}; e.g. "
                              "a BOS added twice), so it answered other prompts than the other arms"] if differ else [])
                            + blas_warnings + tail_warnings}
