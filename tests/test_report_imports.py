"""Importing the report loads neither MLX nor mlx-lm nor any engine: it reads records only.

`python -X importtime` names every module an import loads, once each, however it got there,
so this holds what tests/test_imports.py reads from source against what Python really does
(a library that imports MLX itself would show here and not there).
"""

import subprocess
import sys

import pytest

from tests.test_imports import REPO

REPORT = ("report.frames", "report.document", "report.__main__")


def loaded(statement: str) -> list[str]:
    """The modules `statement` loads in a fresh interpreter started in the repository."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", statement], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # each line: "import time: <self us> | <cumulative us> | <indent><module>"
    rows = [line.split("|") for line in r.stderr.splitlines() if line.startswith("import time:")]
    return [row[2].strip() for row in rows[1:]]  # the first row is the header


def forbidden(names: list[str]) -> list[str]:
    return [n for n in names if n == "mlx" or n.startswith(("mlx.", "mlx_lm", "engines"))]


@pytest.mark.parametrize("module", REPORT)
def test_importing_the_report_loads_no_mlx_no_mlx_lm_and_no_engines(module):
    names = loaded(f"import {module}")
    assert module in names, f"importtime listed no {module}: its output format changed, so this test sees nothing"
    assert not forbidden(names), (f"import {module} loads {forbidden(names)}; find the chain with python -X importtime "
                                  f"-c 'import {module}' (tests/test_imports.py names the chain from source)")


def test_the_check_sees_mlx_that_the_measurement_modules_load():
    # the planted break: the measurement side does load MLX, mlx-lm and the engines
    found = forbidden(loaded("import report.frames, harness.generation"))
    assert "mlx.core" in found and "engines.base" in found and any(n.startswith("mlx_lm") for n in found)
