"""What records say about the machine: the BLAS that really serves mlx."""

import ctypes
import sys

import pytest

from harness.env import blas_kind, blas_library


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU wheel's BLAS question is a Linux one")
def test_the_recorded_blas_is_one_library_that_defines_cblas_sgemm():
    import numpy  # noqa: F401 -- numpy brings its own (symbol-prefixed) OpenBLAS, which must not count

    path = blas_library()
    assert "," not in path and path != "unknown", path
    assert hasattr(ctypes.CDLL(path), "cblas_sgemm")
    assert blas_kind(path) in ("reference", "openblas", "mkl", "blis")


def test_a_cpu_run_on_the_reference_blas_is_warned_with_its_cost_reason_and_fix():
    from harness.env import blas_warning

    env = {"backend": "cpu", "blas_kind": "reference", "blas": "/x/libblas-bd8a282c.so.3.10.0",
           "blas_selection": {"requested": "auto", "reason": "auto: no optimized BLAS found"}}
    text = blas_warning(env)
    assert "REFERENCE BLAS" in text and "/x/libblas-bd8a282c.so.3.10.0" in text
    assert "8 tokens" in text and "no optimized BLAS found" in text and "pip install mkl" in text
    assert len(text.splitlines()) >= 5
    assert "unset SPEC_HARNESS_BLAS" in blas_warning({**env, "blas_selection": {"requested": "reference"}})
    for quiet in ({**env, "blas_kind": "mkl"}, {**env, "blas_kind": "openblas"}, {**env, "backend": "cuda"},
                  {**env, "backend": "metal", "blas_kind": "metal"}):
        assert blas_warning(quiet) is None, quiet
    fell_back = {**env, "blas_kind": "mkl", "blas": "/v/lib/libmkl_rt.so.3",
                 "blas_selection": {"tried": [{"path": "/usr/lib/libopenblas.so.0", "env": {}, "error": "SIGILL"}],
                                    "reason": "auto: loaded /v/lib/libmkl_rt.so.3, after /usr/lib/libopenblas.so.0: SIGILL"}}
    assert "/v/lib/libmkl_rt.so.3 serves" in blas_warning(fell_back) and "SIGILL" in blas_warning(fell_back)


def test_the_record_says_which_blas_was_chosen_and_why_beside_the_one_that_serves():
    from harness.env import environment

    env = environment()
    assert {"blas", "blas_kind", "blas_selection", "blas_env", "blas_warning"} <= set(env)
    sel = env["blas_selection"]
    assert {"requested", "action", "library", "reason", "env_set", "tried"} <= set(sel) and sel["reason"]
    # The warning follows the library that really serves, whatever the selection says.
    assert (env["blas_warning"] is not None) == (env["backend"] == "cpu" and env["blas_kind"] == "reference")


@pytest.mark.parametrize("user", [None, "1"])
def test_float32_means_float32_unless_the_user_asks_for_tf32(user):
    # TF32 would let a verify and a decode step round differently in float32 (the lossless proof).
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    if user is not None:
        env["MLX_ENABLE_TF32"] = user
    code = "import harness, os; from harness.env import environment; print(environment()['mlx_env']['MLX_ENABLE_TF32'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == (user or "0")
