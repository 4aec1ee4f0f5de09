"""harness.blas picks the BLAS that serves mlx before mlx loads; the suite never depends on it.

Selection tests run select()'s logic against fake candidates, a fake loader and a fake
probe (nothing is loaded into the test process). The probe and the end-to-end tests build
tiny shared libraries with the C compiler, or use an optimized BLAS found on the machine
(skipped where there is none).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from harness import blas
from tests.conftest import REPO

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the BLAS choice is a Linux question")


class Loader:
    """Records (path, mode) calls; raises OSError for paths in `fail`."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def __call__(self, path, mode):
        self.calls.append((path, mode))
        if path in self.fail:
            raise OSError(f"{path}: cannot open shared object file")
        return object()

    @property
    def paths(self):
        return [p for p, _ in self.calls]


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Linux x86_64, mlx not imported, nothing in the global scope, three candidates of
    which the first is absent: returns (candidates, environ)."""
    files = {name: tmp_path / name for name in ("absent-mkl.so", "libmkl_rt.so.3", "libopenblas.so.0")}
    files["libmkl_rt.so.3"].write_bytes(b"")
    files["libopenblas.so.0"].write_bytes(b"")
    cands = [blas.Candidate("mkl", str(files["absent-mkl.so"]), {"MKL_THREADING_LAYER": "SEQUENTIAL"}),
             blas.Candidate("mkl", str(files["libmkl_rt.so.3"]), {"MKL_THREADING_LAYER": "SEQUENTIAL"}),
             blas.Candidate("openblas", str(files["libopenblas.so.0"]), {"OPENBLAS_NUM_THREADS": "1"})]
    monkeypatch.setattr(blas, "candidates", lambda: cands)
    monkeypatch.setattr(blas, "_platform", lambda: ("linux", "x86_64"))
    monkeypatch.setattr(blas, "_mlx_imported", lambda: False)
    monkeypatch.setattr(blas, "defining_library", lambda scope, symbol: None)
    monkeypatch.setattr(blas, "_cuda_package", lambda: None)
    blas.reset()
    yield cands, {}
    blas.reset()


def ok(path, environ, needs=()):
    return None


def test_the_first_present_candidate_is_loaded_globally_with_its_threading_knobs(world):
    cands, environ = world
    loader = Loader()
    s = blas.select(environ, loader, ok)
    assert s["action"] == "loaded" and s["library"] == cands[1].path and s["kind"] == "mkl"
    assert loader.calls == [(cands[1].path, os.RTLD_GLOBAL | os.RTLD_NOW)]  # the absent one is never tried
    assert environ == {"MKL_THREADING_LAYER": "SEQUENTIAL"} and s["env_set"] == environ


def test_the_preference_order_is_mkl_on_tbb_then_openblas_then_mkl_on_other_threads():
    order = [(c.kind, c.path, c.env.get("MKL_THREADING_LAYER")) for c in blas.candidates("/venv", "x86_64")]
    assert order[0] == ("mkl", "/venv/lib/libmkl_rt.so.3", "TBB")
    assert blas.candidates("/venv", "x86_64")[0].needs == ("/venv/lib/libtbb.so.12",)
    kinds = [k if k == "openblas" else f"{k}-{layer}" for k, _, layer in order]
    assert kinds == sorted(kinds, key=["mkl-TBB", "openblas", "mkl-GNU", "mkl-SEQUENTIAL"].index)
    openblas = [p for k, p, _ in order if k == "openblas"]
    assert openblas[:2] == ["/venv/lib/libopenblas.so.0", "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"]


def test_a_candidates_prerequisites_load_first_and_an_absent_one_skips_it(world, tmp_path, monkeypatch):
    cands, environ = world
    tbb = tmp_path / "libtbb.so.12"
    needy = blas.Candidate("mkl", cands[1].path, {"MKL_THREADING_LAYER": "TBB"}, (str(tbb),))
    monkeypatch.setattr(blas, "candidates", lambda: [needy, cands[2]])
    loader = Loader()
    assert blas.select(dict(environ), loader, ok)["library"] == cands[2].path  # libtbb absent: skipped

    tbb.write_bytes(b"")
    blas.reset()
    loader = Loader()
    seen = []
    s = blas.select(environ, loader, lambda p, env, needs: seen.append(needs))
    assert s["library"] == cands[1].path and seen == [(str(tbb),)]
    assert loader.paths == [str(tbb), cands[1].path] and environ["MKL_THREADING_LAYER"] == "TBB"


def test_a_library_that_fails_its_probe_is_passed_over_and_its_knobs_undone(world):
    cands, environ = world
    loader = Loader()
    s = blas.select(environ, loader, lambda p, env, needs: "killed by signal 4 (SIGILL)" if "mkl" in p else None)
    assert s["action"] == "loaded" and s["library"] == cands[2].path
    assert [(t["path"], t["error"]) for t in s["tried"]] == [(cands[1].path, "killed by signal 4 (SIGILL)")]
    assert loader.paths == [cands[2].path]  # the failed one never entered this process
    assert environ == {"OPENBLAS_NUM_THREADS": "1"}  # MKL's knob was removed again
    assert "SIGILL" in s["reason"]


def test_a_library_that_fails_to_load_falls_back_to_the_next(world):
    cands, environ = world
    s = blas.select(environ, Loader(fail={cands[1].path}), ok)
    assert s["action"] == "loaded" and s["library"] == cands[2].path
    assert "cannot open" in s["tried"][0]["error"] and "cannot open" in s["reason"]


def test_when_nothing_loads_the_reference_blas_serves_and_the_reason_says_why(world, capsys):
    cands, environ = world
    s = blas.select(environ, Loader(fail={cands[1].path, cands[2].path}), ok)
    assert s["action"] == "skipped" and s["library"] is None and environ == {}
    assert "reference BLAS serves" in s["reason"] and cands[2].path in s["reason"]
    assert capsys.readouterr().err == ""  # select() stays silent: the cell's start says it (env.blas_warning)


def test_with_no_candidate_on_disk_the_reason_names_the_fix(world, monkeypatch):
    monkeypatch.setattr(blas, "candidates", lambda: [blas.Candidate("mkl", "/nonexistent/libmkl_rt.so.3")])
    loader = Loader()
    s = blas.select({}, loader, ok)
    assert s["action"] == "skipped" and loader.calls == [] and "pip install mkl" in s["reason"]


def test_reference_opts_out_without_loading_anything(world):
    _, environ = world
    environ[blas.ENV] = "reference"
    loader = Loader()
    s = blas.select(environ, loader, ok)
    assert s["action"] == "skipped" and loader.calls == [] and "reference" in s["reason"]


def test_a_kind_request_takes_the_first_candidate_of_that_kind(world):
    cands, environ = world
    environ[blas.ENV] = "openblas"
    s = blas.select(environ, Loader(), ok)
    assert s["library"] == cands[2].path and s["kind"] == "openblas"


def test_an_explicit_path_is_tried_first_and_a_failure_falls_back(world, tmp_path):
    cands, environ = world
    mine = str(tmp_path / "libmyblas.so")
    environ[blas.ENV] = mine
    loader = Loader()
    s = blas.select(environ, loader, lambda p, env, needs: "cannot open" if p == mine else None)
    assert s["library"] == cands[1].path and s["tried"][0]["path"] == mine

    blas.reset()
    loader = Loader()
    s = blas.select(dict(environ), loader, ok)
    assert s["library"] == mine and loader.paths == [mine]


def test_a_blas_preloaded_by_the_user_is_kept(world, monkeypatch):
    _, environ = world
    environ["LD_PRELOAD"] = "/opt/libopenblas.so.0"
    monkeypatch.setattr(blas, "defining_library", lambda scope, symbol: "/opt/libopenblas.so.0" if scope is None else None)
    loader = Loader()
    s = blas.select(environ, loader, ok)
    assert s["action"] == "kept" and s["library"] == "/opt/libopenblas.so.0" and s["kind"] == "openblas"
    assert loader.calls == [] and "LD_PRELOAD" in s["reason"]


def test_after_mlx_is_imported_nothing_is_loaded_and_it_says_why(world, monkeypatch):
    _, environ = world
    monkeypatch.setattr(blas, "_mlx_imported", lambda: True)
    loader = Loader()
    s = blas.select(environ, loader, ok)
    assert s["action"] == "too-late" and loader.calls == [] and environ == {}
    assert "imported before" in s["reason"]


@pytest.mark.parametrize("system, cuda, word", [(("darwin", "arm64"), None, "darwin"),
                                                (("linux", "x86_64"), "mlx-cuda-13", "mlx-cuda-13")])
def test_macos_and_the_cuda_backend_are_left_alone(world, monkeypatch, system, cuda, word):
    _, environ = world
    monkeypatch.setattr(blas, "_platform", lambda: system)
    monkeypatch.setattr(blas, "_cuda_package", lambda: cuda)
    loader = Loader()
    s = blas.select(environ, loader, ok)
    assert s["action"] == "skipped" and loader.calls == [] and word in s["reason"]


def test_threading_knobs_the_user_set_are_not_overridden(world):
    _, environ = world
    environ["MKL_THREADING_LAYER"] = "GNU"
    s = blas.select(environ, Loader(), ok)
    assert s["action"] == "loaded" and environ["MKL_THREADING_LAYER"] == "GNU" and s["env_set"] == {}


def test_select_decides_once_per_process(world):
    _, environ = world
    loader = Loader()
    first = blas.select(environ, loader, ok)
    assert blas.select(environ, loader, ok) is first and len(loader.calls) == 1
    assert blas.selection() is first


def test_kind_of_reads_through_symlinks(tmp_path):
    real = tmp_path / "openblas-pthread" / "libblas.so.3"
    real.parent.mkdir()
    real.write_bytes(b"")
    alias = tmp_path / "libblas.so.3"
    alias.symlink_to(real)
    assert blas.kind_of(str(alias)) == "openblas"
    assert blas.kind_of("/x/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0") == "reference"
    assert blas.kind_of("/v/lib/libmkl_rt.so.3") == "mkl"


# --- the probe, against libraries built here ---------------------------------------------

FAKE = {
    # dies of SIGILL at its first product, like a BLAS built for another CPU
    "trap": "void cblas_sgemm(void){__builtin_trap();} void cblas_dgemm(void){} void cblas_cgemm(void){}",
    # symbol-prefixed, like scipy-openblas32
    "prefixed": "void scipy_cblas_sgemm(void){} void scipy_cblas_dgemm(void){} void scipy_cblas_cgemm(void){}",
    # exports the names but multiplies wrongly (writes zeros)
    "wrong": """void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float al, const float *a, int lda,
                                const float *b, int ldb, float be, float *c, int ldc)
                { for (int i = 0; i < m * n; i++) c[i] = 0.0f; }
                void cblas_dgemm(void){} void cblas_cgemm(void){}""",
    # multiplies right only through a symbol of another library it does not list as needed
    # (as libmkl_tbb_thread needs libtbb), which must be in the global scope first
    "needy": """int dep_value(void);
                void cblas_sgemm(int o, int ta, int tb, int m, int n, int k, float al, const float *a, int lda,
                                 const float *b, int ldb, float be, float *c, int ldc)
                { for (int i = 0; i < m * n; i++) c[i] = (float) dep_value(); }
                void cblas_dgemm(void){} void cblas_cgemm(void){}""",
    "dep": "int dep_value(void){return 32;}",
}


@pytest.fixture(scope="module")
def fake_libs(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or sys.platform != "linux":
        pytest.skip("needs a C compiler on Linux to build fake BLAS libraries")
    d = tmp_path_factory.mktemp("fakeblas")
    out = {}
    for name, src in FAKE.items():
        (d / f"{name}.c").write_text(src)
        out[name] = str(d / f"lib{name}.so")
        subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", out[name], str(d / f"{name}.c")], check=True)
    return out


@pytest.mark.parametrize("name, words", [("trap", "SIGILL"), ("prefixed", "exports no cblas_sgemm"),
                                         ("wrong", "gave 0.0")])
def test_the_probe_rejects_a_library_that_would_crash_or_cannot_serve(fake_libs, name, words):
    error = blas.probe(fake_libs[name], os.environ)
    assert error is not None and words in error, error


def test_the_probe_loads_a_candidates_prerequisites_first(fake_libs):
    assert "dep_value" in (blas.probe(fake_libs["needy"], os.environ) or "")
    assert blas.probe(fake_libs["needy"], os.environ, (fake_libs["dep"],)) is None


def test_the_probe_rejects_a_missing_file():
    assert "No such file" in (blas.probe("/nonexistent/libblas.so", os.environ) or "")


def _optimized_blas() -> blas.Candidate | None:
    """The first candidate present here that passes its probe: what auto must pick."""
    return next((c for c in blas.candidates() if all(map(os.path.exists, (c.path, *c.needs)))
                 and blas.probe(c.path, {**os.environ, **c.env}, c.needs) is None), None)


def _run(code: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and k != blas.ENV}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**clean, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


SERVED = ("import json, harness.blas as b; s = b.select(); import mlx.core; from harness.env import blas_library, "
          "blas_kind; p = blas_library(); print(json.dumps({'sel': s, 'served': p, 'kind': blas_kind(p)}))")


@linux_only
def test_auto_loads_the_first_working_candidate_and_it_is_the_one_that_serves_mlx():
    cand = _optimized_blas()
    if cand is None:
        pytest.skip("no optimized BLAS on this machine (pip install mkl, or apt-get install libopenblas0-pthread)")
    out = _run(SERVED)
    assert out["sel"]["action"] == "loaded" and out["sel"]["library"] == cand.path, out["sel"]
    assert os.path.realpath(out["served"]) == os.path.realpath(cand.path) and out["kind"] != "reference", out


@linux_only
def test_opting_out_leaves_the_wheels_reference_blas_serving():
    out = _run(SERVED, **{blas.ENV: "reference"})
    assert out["sel"]["action"] == "skipped" and out["kind"] == "reference", out


@linux_only
def test_a_failing_choice_falls_back_and_the_process_lives(fake_libs):
    out = _run(SERVED, **{blas.ENV: fake_libs["trap"]})
    assert out["sel"]["tried"][0]["path"] == fake_libs["trap"] and "SIGILL" in out["sel"]["tried"][0]["error"]
    assert os.path.realpath(out["served"]) != os.path.realpath(fake_libs["trap"])


def test_the_harness_entry_point_selects_before_anything_imports_mlx():
    out = _run("import json, sys, harness.__main__, harness.blas as b; "
               "print(json.dumps({'mlx': 'mlx.core' in sys.modules, 'action': b.selection()['action']}))",
               **{blas.ENV: "reference"})
    assert out == {"mlx": False, "action": "skipped"}, out


@linux_only
def test_a_launchers_worker_process_selects_too(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the cluster extra: pip install -e '.[cluster]'")
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "harness", "arch=qwen35", "method=base", "hydra/launcher=local_jobs",
                        "bench=smoke", "bench.max_prompts=1", "bench.max_new_tokens=4", "bench.warmup=0",
                        "bench.profile=false", f"out_dir={out}", "-m"], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env={**os.environ, blas.ENV: "reference"})
    assert r.returncode == 0, r.stderr[-2000:]
    (record,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    sel = record["env"]["blas_selection"]
    assert sel["action"] == "skipped" and sel["requested"] == "reference", sel  # not "not-called"
