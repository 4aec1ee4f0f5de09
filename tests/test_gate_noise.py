"""jobs/gate_noise.py: a gate's tables read back and each bound's worst reading against it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gate_noise", Path(__file__).parent.parent / "jobs" / "gate_noise.py")
gate_noise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gate_noise)

TABLE = """\
| check   | metric           | bound   |   value | verdict   |
|---------|------------------|---------|---------|-----------|
| ngram   | speedup          | >= 0.8  |  {a}    | {va}      |
| ngram   | diverged_prompts | <= 0    |  0      | pass      |
| dflash  | speedup          | >= 2    |  missing: a 95% CI needs >= 2 paired reps | FAIL |
"""


def test_rows_margins_and_the_worst_run_per_bound():
    runs = [gate_noise.table_rows(TABLE.format(a=a, va=v)) for a, v in (("0.92", "pass"), ("0.78", "FAIL"))]
    assert [r[:3] for r in runs[0]] == [["ngram", "speedup", ">= 0.8"], ["ngram", "diverged_prompts", "<= 0"],
                                        ["dflash", "speedup", ">= 2"]]
    assert gate_noise.margin(">= 0.8", 0.92) == pytest.approx(0.15)
    assert gate_noise.margin("<= 2.0", 1.5) == pytest.approx(0.25)
    assert gate_noise.margin("<= 0", 0.0) == 0.0
    text = gate_noise.summarize(runs)
    assert "| ngram | speedup | >= 0.8 | 1/2 | 0.78 | 0.92 | -2.5% |" in text
    assert "| ngram | diverged_prompts | <= 0 | 2/2 | 0 | 0 | +0.0% |" in text
    assert "| dflash | speedup | >= 2 | 0/2 | - | - | +nan% |" in text
