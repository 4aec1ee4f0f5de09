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
