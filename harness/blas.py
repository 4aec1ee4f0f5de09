"""Which BLAS serves MLX's CPU matmuls: chosen once per process, before MLX loads.

The mlx[cpu] wheel for Linux links the reference BLAS (mlx_cpu.libs/libblas-*.so), where a
float32 forward over 8 tokens of SmolLM2-135M costs ~7 one-token forwards on 2 cores: batched
verify cannot pay off. libmlx imports only cblas_{s,d,c}gemm and LAPACK symbols, and the
dynamic linker searches the global scope before a library's own dependencies, so an
optimized BLAS loaded RTLD_GLOBAL before `import mlx.core` serves those calls instead, with
no LD_PRELOAD and no re-exec. Each entry point that runs models calls select() first thing;
env.environment() records the library that really serves cblas_sgemm (the truth) beside
selection() (what was chosen, and why).

SPEC_HARNESS_BLAS picks: auto (default: the first of candidates() that passes its probe and
loads), reference (keep the wheel's), openblas or mkl (the first candidate of that kind), or
a path to a shared library that exports cblas_sgemm. A BLAS already in the global scope
(LD_PRELOAD) is kept. Threading knobs the user set are never overridden.

The order is measured: real SmolLM2-135M in float32 (GGUF dequantized), harness.calibrate's
calibrate at 200 tokens of context, 2-core AMD EPYC (Zen 3, AVX2), ms, 3 runs (min-max):

    BLAS (threads)                       decode 1 token   verify 8 tokens   ratio
    mlx wheel's reference                     261-271        1746-1887     6.4-7.0
    MKL 2026.2, TBB (2)                        90-98          170-183      1.86-1.88
    OpenBLAS 0.3.21, Debian 12 (2)            129-138         198-220      1.54-1.60
    OpenBLAS 0.3.21, OPENBLAS_NUM_THREADS=1   181-198         224-239      1.21-1.24
    OpenBLAS 0.3.33, ngsolve-openblas (2)     130-162         169-193      1.20-1.30
    MKL, GNU OpenMP (2)                       119-122         226-237      1.86-1.96
    MKL, Intel OpenMP (2)                     115-143         214-258      1.81-1.87
    MKL, SEQUENTIAL (1)                       105-134         220-263      1.97-2.20

MKL on TBB threads decodes fastest and verifies as fast as the best OpenBLAS, so it comes
first although its verify/decode ratio is the higher one (its single-token step is the
cheaper); one OpenBLAS thread lowers the ratio only by slowing decode, so the library's own
default (a thread per core) is kept. MKL_ENABLE_INSTRUCTIONS=AVX2 changed nothing (same
shapes, random weights).
No optimized BLAS is bit-stable across row counts (row i of an 8-row product differs in
the last bits from the 1-row product), so float32 verify matches decode exactly only on the
reference BLAS; elsewhere greedy output can leave base at a near-tie, as on a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata

ENV = "SPEC_HARNESS_BLAS"
FIX = "apt-get install libopenblas0-pthread (best measured), or pip install mkl"
SYMBOLS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")  # what libmlx.so imports from its BLAS

# Threading knobs, set before a library loads (each only where the user has not set it).
# MKL_INTERFACE_LAYER: mlx's bundled LAPACK is built with gfortran, whose complex-valued
# functions (cdotc_, ...) return by value; MKL's default (Intel) convention does not.
MKL_ENV = {"MKL_INTERFACE_LAYER": "GNU,LP64"}


@dataclass(frozen=True)
class Candidate:
    kind: str  # "mkl" | "openblas" | "user"
    path: str
    env: dict = field(default_factory=dict)
    needs: tuple = ()  # libraries loaded into the global scope before it (what it cannot find itself)


def candidates(prefix: str = sys.prefix, machine: str | None = None) -> list[Candidate]:
    """Unprefixed optimized BLAS libraries worth trying, best first (measured: module docstring).

    MKL from PyPI (`pip install mkl` puts libmkl_rt, and its dependency tbb puts libtbb, in
    <prefix>/lib) on TBB threads, which libmkl_tbb_thread finds only once libtbb is loaded;
    then OpenBLAS from a conda env (<prefix>/lib) or the distribution (Debian/Ubuntu's
    multiarch dir, where libopenblas.so.0 is the alternatives link; Fedora's /usr/lib64),
    at its default of one thread per core; then MKL on OpenMP threads (libgomp), then on
    none. select() skips a candidate whose files are absent."""
    machine = machine or platform.machine()
    lib = os.path.join(prefix, "lib")
    multiarch = f"/usr/lib/{machine}-linux-gnu"
    openblas = [os.path.join(lib, "libopenblas.so.0"), os.path.join(multiarch, "libopenblas.so.0"),
                *(os.path.join(multiarch, d, "libopenblas.so.0") for d in ("openblas-pthread", "openblas-openmp")),
                "/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0"]
    mkl = [os.path.join(lib, name) for name in ("libmkl_rt.so.3", "libmkl_rt.so.2")]
    layer = lambda name: {**MKL_ENV, "MKL_THREADING_LAYER": name}
    return [*(Candidate("mkl", p, layer("TBB"), (os.path.join(lib, "libtbb.so.12"),)) for p in mkl),
            *(Candidate("openblas", p) for p in openblas),
            *(Candidate("mkl", p, layer("GNU")) for p in mkl),
            *(Candidate("mkl", p, layer("SEQUENTIAL")) for p in mkl)]


_SELECTION: dict | None = None


def selection() -> dict:
    """What select() did in this process (or that it was not called)."""
    if _SELECTION is None:
        return {"requested": os.environ.get(ENV, "auto"), "action": "not-called", "library": None, "kind": None,
                "needs": [], "reason": "harness.blas.select() was not called in this process", "env_set": {},
                "tried": []}
    return _SELECTION


def select(environ=None, loader=None, check=None) -> dict:
    """Load the best available BLAS into the global scope, once; return what happened.

    Never raises and prints nothing: a library that fails its probe or its load is recorded
    under `tried` and the next one is tried; when none loads, the wheel's reference BLAS
    serves. A run says so at each cell's start (env.blas_warning). `environ`, `loader`
    ((path, mode) -> handle) and `check` (probe()) are seams for the tests."""
    global _SELECTION
    if _SELECTION is None:
        _SELECTION = _select(os.environ if environ is None else environ, loader or ctypes.CDLL, check or probe)
    return _SELECTION


def reset() -> None:
    """Forget the selection (tests only: a library once loaded stays loaded)."""
    global _SELECTION
    _SELECTION = None


def _select(environ, loader, check) -> dict:
    requested = environ.get(ENV, "auto").strip() or "auto"
    out = {"requested": requested, "action": "skipped", "library": None, "kind": None, "needs": [], "reason": "",
           "env_set": {}, "tried": []}
    why_not = _not_applicable(requested)
    if why_not:
        return {**out, "reason": why_not}
    already = defining_library(None, "cblas_sgemm")
    if already:
        where = f"LD_PRELOAD={environ['LD_PRELOAD']}" if environ.get("LD_PRELOAD") else "loaded before select()"
        return {**out, "action": "kept", "library": already, "kind": kind_of(already),
                "reason": f"{already} already serves cblas_sgemm from the global scope ({where}): kept"}
    if requested == "reference":
        return {**out, "reason": f"{ENV}=reference: the mlx wheel's own BLAS serves"}
    if _mlx_imported():
        return {**out, "action": "too-late",
                "reason": "mlx.core was imported before harness.blas.select(), so its BLAS is bound already; "
                          "call select() before importing mlx, or preload one (LD_PRELOAD=/path/to/libblas.so)"}

    pool = candidates()
    if requested in ("mkl", "openblas"):
        pool = [c for c in pool if c.kind == requested]
    elif requested != "auto":
        pool = [Candidate("user", requested)] + pool  # the user's library first; the rest if it fails
    for cand in pool:
        if cand.kind != "user" and not all(map(os.path.exists, (cand.path, *cand.needs))):
            continue
        error, env_set = _load(cand, environ, loader, check)
        if error is None:
            after = f", after {_failures(out['tried'])}" if out["tried"] else ""
            return {**out, "action": "loaded", "library": cand.path, "kind": kind_of(cand.path),
                    "needs": list(cand.needs), "env_set": env_set,
                    "reason": f"{ENV}={requested}: loaded {cand.path}{_env_words(cand.env)} before mlx{after}"}
        out["tried"].append({"path": cand.path, "env": dict(cand.env), "error": error})
    if out["tried"]:
        return {**out, "reason": f"{ENV}={requested}: no optimized BLAS would load ({_failures(out['tried'])}); "
                                 "the reference BLAS serves"}
    return {**out, "reason": f"{ENV}={requested}: no optimized BLAS found ({FIX}); the reference BLAS serves"}


def _failures(tried: list[dict]) -> str:
    return "; ".join(f"{t['path']}{_env_words(t['env'])}: {t['error']}" for t in tried)


def _env_words(env: dict) -> str:
    return f" ({', '.join(f'{k}={v}' for k, v in env.items())})" if env else ""


def _mlx_imported() -> bool:
    return "mlx.core" in sys.modules


def _platform() -> tuple[str, str]:
    return sys.platform, platform.machine()


def _not_applicable(requested: str) -> str | None:
    system, machine = _platform()
    if system != "linux":
        return f"{system}: the mlx wheel's own BLAS (Accelerate on macOS) serves"
    if machine != "x86_64" and requested in ("auto", "mkl"):
        return f"Linux {machine}: no measured BLAS choice for this machine (set {ENV}=/path/to/libblas.so)"
    cuda = _cuda_package()
    if cuda:
        return f"{cuda} is installed: matmuls run on the GPU, the CPU BLAS is left as it is"
    return None


CUDA_PACKAGES = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")


def _cuda_package() -> str | None:
    # Looked up by name: reading every installed distribution's metadata costs ~70 ms.
    for name in CUDA_PACKAGES:
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            pass
    return None


# Run in a fresh interpreter: load the library as select() will, check the symbols libmlx
# needs, and multiply with it. A library built for another CPU dies of SIGILL at its first
# product (seen: a SKYLAKEX-only OpenBLAS wheel on an AMD EPYC), which only a child survives.
PROBE = r"""
import ctypes, sys
path, needs = sys.argv[1], sys.argv[2].split("\n") if sys.argv[2] else []
for need in needs:
    ctypes.CDLL(need, mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
missing = [s for s in sys.argv[3:] if not hasattr(lib, s)]
if missing:
    sys.exit("exports no " + ", ".join(missing) + " (a symbol-prefixed build cannot serve libmlx)")
for m, n, k in ((1, 64, 64), (8, 64, 64), (64, 64, 64)):
    a, b, c = (ctypes.c_float * (m * k))(*[1.0] * (m * k)), (ctypes.c_float * (n * k))(*[0.5] * (n * k)), (ctypes.c_float * (m * n))()
    lib.cblas_sgemm(101, 111, 112, m, n, k, ctypes.c_float(1.0), a, k, b, k, ctypes.c_float(0.0), c, n)
    if any(x != 32.0 for x in c):
        sys.exit(f"cblas_sgemm gave {c[0]} for 32.0 ({m}x{k} @ {k}x{n})")
"""


def probe(path: str, environ, needs: tuple = ()) -> str | None:
    """None when `path` (after `needs`) loads and multiplies correctly in a child process,
    under `environ`; else why not."""
    try:
        r = subprocess.run([sys.executable, "-I", "-S", "-c", PROBE, path, "\n".join(needs), *SYMBOLS],
                           env=dict(environ), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"probe failed to run: {e}"
    if r.returncode == 0:
        return None
    if r.returncode < 0:
        return f"killed by signal {-r.returncode} ({_signame(-r.returncode)}) multiplying with it"
    lines = (r.stderr or r.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit status {r.returncode}"


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return "?"


def _load(cand: Candidate, environ, loader, check) -> tuple[str | None, dict]:
    """Probe `cand`, then load it into this process's global scope. (error or None, env set)."""
    env_set = {k: v for k, v in cand.env.items() if k not in environ}
    environ.update(env_set)  # read by the library when it loads or first runs
    error = check(cand.path, environ, cand.needs)
    if error is None:
        try:
            for lib in (*cand.needs, cand.path):
                loader(lib, os.RTLD_GLOBAL | os.RTLD_NOW)
        except OSError as e:
            error = str(e).strip() or "OSError"
    if error is not None:
        for k in env_set:
            environ.pop(k, None)
        return error, {}
    return None, env_set


def kind_of(path: str) -> str:
    """openblas | mkl | blis | accelerate | reference | unknown, from a library's (real) path."""
    p = (path + " " + os.path.realpath(path)).lower() if path.startswith("/") else path.lower()
    for kind in ("openblas", "mkl", "blis", "accelerate"):
        if kind in p:
            return kind
    return "reference" if "libblas" in p else "unknown"


def defining_library(scope: str | None, symbol: str) -> str | None:
    """The file that defines `symbol` as dlsym finds it in `scope` (None: the global scope)."""

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        libdl = ctypes.CDLL(ctypes.util.find_library("dl") or "libc.so.6")
        addr = ctypes.cast(getattr(ctypes.CDLL(scope), symbol), ctypes.c_void_p).value
        info = DlInfo()
        if libdl.dladdr(ctypes.c_void_p(addr), ctypes.byref(info)):
            return info.dli_fname.decode()
    except (AttributeError, OSError):
        pass
    return None


def child_blas(sel: dict | None = None) -> dict:
    """What a process the harness starts (an outside engine, a server) is given so that its MLX
    multiplies on this process's BLAS: the selected library and what it needs, to preload in
    that order, and the settings select() made for it. Nothing where this process runs on the
    wheel's own BLAS (or on a GPU): the child's wheel then gives it the same."""
    sel = sel or selection()
    library = sel.get("library") if sel.get("action") in ("loaded", "kept") else None
    return {"library": library, "kind": kind_of(library) if library else None,
            "preload": [*sel.get("needs", []), library] if library else [],
            "env_set": dict(sel.get("env_set") or {}) if library else {}}


def child_env(environ=None, sel: dict | None = None) -> dict:
    """The environment for a process the harness starts: this one's, with child_blas()'s
    libraries appended to LD_PRELOAD (after any the user set; one already there is not added
    twice) and its settings where the environment has none. The library was loaded here with
    dlopen, which a child does not inherit: without LD_PRELOAD, a child running MLX multiplies
    on the wheel's reference BLAS (examples/mlx_lm_adapter.py as an arm read 0.38x base so)."""
    env = dict(os.environ if environ is None else environ)
    given = child_blas(sel)
    for key, value in given["env_set"].items():
        env.setdefault(key, value)
    have = env.get("LD_PRELOAD", "").replace(":", " ").split()  # ld.so splits it at spaces and colons
    add = [p for p in given["preload"] if os.path.realpath(p) not in map(os.path.realpath, have)]
    if add:
        env["LD_PRELOAD"] = ":".join(x for x in (env.get("LD_PRELOAD", "").strip(), *add) if x)
    return env
