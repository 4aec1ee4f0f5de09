"""Facts about where a measurement ran, recorded in every record.

The BLAS matters on Linux: the mlx CPU wheel bundles the reference BLAS, where a
forward over T tokens costs about T single-token forwards; with an optimized BLAS
(harness.blas loads one before mlx) batched verify costs little more than one. We
record which library actually provides cblas_sgemm in this process (`blas`), not which
one is installed, beside what harness.blas chose and why (`blas_selection`).
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from harness import blas as _blas

REPO = Path(__file__).resolve().parent.parent


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def blas_library() -> str:
    """Path of the shared library that serves libmlx's cblas_sgemm here (or what is known)."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "Accelerate (macOS)"
    if sys.platform != "linux":
        return "unknown"
    mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))  # make sure libmlx and its BLAS are loaded
    # Global scope first: a BLAS preloaded there (LD_PRELOAD) binds libmlx's calls before
    # its own dependency does. Otherwise libmlx's dependency tree decides (dlsym on its
    # handle); other BLAS copies in the process (numpy's, prefixed symbols) do not count.
    mapped = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "/" in line}
    scopes = [None, *sorted(p for p in mapped if Path(p).name.startswith("libmlx"))]
    for scope in scopes:
        path = _blas.defining_library(scope, "cblas_sgemm")
        if path:
            return path
    return "unknown"


blas_kind = _blas.kind_of

# What the reference BLAS costs (harness/blas.py's table: random llama at SmolLM2-135M's shapes).
REFERENCE_COST = "a float32 forward over 8 tokens costs 6-7 single-token forwards (SmolLM2-135M, 2 cores)"


def blas_warning(env: dict) -> str | None:
    """Lines to print at a cell's start when the reference BLAS serves CPU matmuls, or a
    library harness.blas tried failed; None when all is as it should be."""
    if env.get("backend") != "cpu":
        return None
    sel = env.get("blas_selection") or {}
    if env.get("blas_kind") != "reference":
        return f"!! BLAS: {env.get('blas')} serves; {sel.get('reason')}" if sel.get("tried") else None
    fix = ("unset SPEC_HARNESS_BLAS (it is 'reference')" if sel.get("requested") == "reference"
           else f"{_blas.FIX}, then run again; SPEC_HARNESS_BLAS=/path/to/libblas.so picks one")
    return "\n".join([
        "!! " + "=" * 76,
        f"!! REFERENCE BLAS: {env.get('blas')} serves this run's CPU matmuls.",
        f"!! With it {REFERENCE_COST},",
        "!! so batched verify cannot pay off: speculative speedups measured here understate the methods.",
        f"!! Why: {sel.get('reason', 'unknown')}",
        f"!! Fix: {fix}.",
        "!! " + "=" * 76])


def git_sha() -> dict:
    """The harness's git commit; SPEC_HARNESS_GIT_SHA stands in where the tree has no .git
    (a copied working tree, e.g. on a remote GPU machine)."""
    if os.environ.get("SPEC_HARNESS_GIT_SHA"):
        return {"sha": os.environ["SPEC_HARNESS_GIT_SHA"], "dirty": None}

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)

    try:
        sha = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    if sha.returncode != 0:
        return {"sha": None, "dirty": None}
    return {"sha": sha.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


@lru_cache(maxsize=1)
def environment() -> dict:
    import mlx.core as mx

    device = mx.default_device()
    info = {}
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))}
    except (AttributeError, RuntimeError):
        pass
    backend = "metal" if mx.metal.is_available() else ("cuda" if mx.cuda.is_available() else "cpu")
    blas = blas_library() if backend == "cpu" else None
    env = {
        "host": socket.gethostname(), "cpus": os.cpu_count(),
        "mlx": _version("mlx"), "mlx_lm": _version("mlx-lm"), "mlx_backend_pkg": _version("mlx-cuda-13") or _version("mlx-cpu"),
        "python": platform.python_version(), "platform": platform.platform(),
        "machine": platform.machine(), "processor": _cpu_name(),
        "device": str(device), "device_name": info.get("device_name"), "backend": backend, "device_info": info,
        "blas": blas, "blas_kind": blas_kind(blas) if blas else backend,
        "blas_selection": _blas.selection(),
        "blas_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(BLAS_ENV_PREFIXES)},
        "mlx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")},
        "git": git_sha(),
    }
    env["blas_warning"] = blas_warning(env)
    return env


BLAS_ENV_PREFIXES = ("MKL_", "OPENBLAS_", "GOTO_", "OMP_", "KMP_", "SPEC_HARNESS_BLAS", "LD_PRELOAD")


STREAM_PROBE = "[1, 1024] @ [R, 1024].T, R * 1024 of the weights' size (at most 1 GiB), median of 7"


@lru_cache(maxsize=8)
def stream_rate(dtype: str, nbytes: int, n: int = 7) -> float:
    """GB/s at which this backend streams an `nbytes` matrix through a matrix-vector product.

    Single-token decode reads every weight once per token through such products, so
    weight bytes / this rate bounds its tok/s from above (KV reads come on top). The
    probe (STREAM_PROBE) is the model's own size, so cache residency counts as it does
    for the model."""
    import mlx.core as mx

    dt = getattr(mx, dtype)
    cols = 1024
    rows = max(1, min(nbytes, 2**30) // (cols * dt.size))
    w = mx.full((rows, cols), 0.5, dtype=dt)  # [R, C]: the model's weight bytes in one matrix
    x = mx.full((1, cols), 1.0, dtype=dt)  # [1, C]: one token, multiplied as nn.Linear does (x @ W.T)
    mx.eval(w, x, x @ w.T)  # materialise, and run the product once untimed
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - t0)
    return w.nbytes / statistics.median(times) / 1e9


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class LoadMeter:
    """What else ran on this machine while a cell was measured.

    other_cpu_share: CPU time the machine spent busy outside this process (from /proc/stat
    and this process's own CPU time), as a share of all its cores over the cell's wall time.
    A paired ratio survives steady background load better than absolute tok/s, but not load
    that comes and goes between reps; the report and the gate warn above
    harness/records.LOAD_WARN."""

    def __enter__(self):
        self.t0, self.own0, self.busy0 = time.perf_counter(), time.process_time(), _machine_busy()
        self.loadavg_before = _loadavg()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        own, busy = time.process_time() - self.own0, _machine_busy()
        share = None
        if busy is not None and self.busy0 is not None and wall > 0:
            share = max(0.0, (busy - self.busy0 - own) / (wall * (os.cpu_count() or 1)))
        self.record = {"loadavg_before": self.loadavg_before, "loadavg_after": _loadavg(),
                       "other_cpu_share": share, "cpus": os.cpu_count()}
        return False


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _machine_busy() -> float | None:
    # Seconds all CPUs spent busy since boot (/proc/stat: every field but idle and iowait).
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(fields[:8]) - fields[3] - fields[4]) / hz
