"""The device lock: one timed cell per compute device of a host at a time.

Cells launched in parallel (local processes, several jobs on one node) take turns on the
device, because two timed cells sharing it make both cells' tok/s, and so every ratio,
meaningless. The lock is a file in SPEC_HARNESS_LOCK_DIR (else the host's temp dir), made
on first use; a directory that cannot hold it is a one-line ConfigError naming the variable.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from harness.errors import ConfigError


class LockTimeout(RuntimeError):
    """The device stayed held by another run for longer than lock_timeout_s."""


LOCK_DIR_ENV = "SPEC_HARNESS_LOCK_DIR"


def lock_dir() -> Path:
    """Where device locks live, made if missing; ConfigError naming SPEC_HARNESS_LOCK_DIR when it
    cannot be made or written (the test suite sets its own, so it never queues behind a user's run)."""
    chosen = os.environ.get(LOCK_DIR_ENV)
    path = Path(chosen or tempfile.gettempdir())
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        where = f"{LOCK_DIR_ENV}={chosen}" if chosen else f"the temp dir {path} (set {LOCK_DIR_ENV})"
        raise ConfigError(f"{where} cannot hold the device lock: {e.strerror or e} ({e.filename or path}); "
                          f"set {LOCK_DIR_ENV} to a writable directory") from None
    return path


def device_lock_path() -> Path:
    """One lock per device on this host: the CPU, the GPUs a CUDA process sees, or Metal."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        device = "cpu"  # launchers set CUDA_VISIBLE_DEVICES per job, but CPU cells all share the cores
    elif mx.metal.is_available():
        device = "metal"
    else:
        device = "cuda-" + (os.environ.get("CUDA_VISIBLE_DEVICES") or "all").replace(",", "_")
    return lock_dir() / f"spec-harness-device-{device}.lock"


def lock_holder(path: Path) -> str:
    """Who holds the device lock at `path`, as its holder wrote it: pid, command, since when."""
    try:
        h = json.loads(Path(path).read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        h = {}
    if not h.get("pid"):
        return "a process that did not say who it is"
    since = time.strftime("%H:%M:%S", time.localtime(h["since"]))
    return f"pid {h['pid']} ({h.get('cmd', '?')[:120]}) since {since}, {_ago(time.time() - h['since'])} ago"


def _ago(s: float) -> str:
    s = int(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@contextmanager
def device_lock(shared: bool = False, timeout_s: float | None = None, log=None, poll_s: float = 0.25,
                every_s: float = 30.0):
    """Hold this host's compute device for the measurement: cells launched in parallel (local
    processes, several jobs on one node) take turns on it, because two timed cells sharing a
    device make both cells' tok/s, and so every ratio, meaningless. The lock lives in this
    host's temp dir (per GPU set under CUDA_VISIBLE_DEVICES). While it waits, `log` hears who
    holds it (pid, command, since when), then again every `every_s`; past `timeout_s` it raises
    LockTimeout naming the holder. Yields a function giving the seconds spent waiting.
    `shared=True` (allow_shared_device) skips it."""
    start = time.perf_counter()
    waited = [0.0]
    if shared:
        yield lambda: 0.0
        return
    path = device_lock_path()
    with open(path, "a+") as fh:
        _acquire(fh, path, start, timeout_s, log or (lambda msg: None), poll_s, every_s)
        waited[0] = time.perf_counter() - start
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps({"pid": os.getpid(), "cmd": " ".join(sys.argv), "since": time.time()}))
        fh.flush()
        try:
            yield lambda: waited[0]
        finally:
            fh.truncate(0)
            fcntl.flock(fh, fcntl.LOCK_UN)


def _acquire(fh, path: Path, start: float, timeout_s, log, poll_s: float, every_s: float) -> None:
    told = None
    while True:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if told is not None:
                log(f"  device free after {time.perf_counter() - start:.1f}s of waiting")
            return
        except BlockingIOError:
            pass
        now = time.perf_counter()
        if timeout_s is not None and now - start >= timeout_s:
            raise LockTimeout(f"the device is still held after {timeout_s:g}s (lock_timeout_s) by "
                              f"{lock_holder(path)}; lock file {path}. Wait for it, raise lock_timeout_s, or "
                              "set allow_shared_device=true (both runs' timings then suffer)")
        if told is None or now - told >= every_s:
            limit = f", giving up after {timeout_s:g}s" if timeout_s is not None else ""
            log(f"  waiting for the device: held by {lock_holder(path)} [{path}]{limit}")
            told = now
        time.sleep(poll_s)
