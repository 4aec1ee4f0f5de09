"""The profiler's host split: each phase's time before its barrier, recorded per round, read by
the report where records hold it and left out where older records do not."""

from __future__ import annotations

import pytest

from harness.generation import round_table
from report.document import host_section
from report.frames import profiles
from tests.test_report_axes import _record
from tests.test_round_accounting import _oracle_run


def test_every_profiled_round_splits_each_phase_into_host_time_and_the_rest(models):
    gen, _ = _oracle_run(models, 12, profile=True)
    assert gen.rounds
    for r in gen.rounds:
        assert set(r.host) == set(r.phases) >= {"draft", "verify", "accept", "rollback"}
        assert all(0.0 <= r.host[p] <= r.phases[p] for p in r.phases)
    assert sum(r.host["verify"] for r in gen.rounds) < sum(r.phases["verify"] for r in gen.rounds)
    table = round_table(gen)
    assert set(table["phase_host_ms"]) == set(table["phase_ms"])
    for p, ms in table["phase_host_ms"].items():
        assert len(ms) == len(gen.rounds) and all(h <= t for h, t in zip(ms, table["phase_ms"][p]))


def test_unprofiled_rounds_record_no_host_split(models):
    gen, _ = _oracle_run(models, 12)
    assert all(r.host is None for r in gen.rounds) and "phase_host_ms" not in round_table(gen)


def _with_host(rec, host: dict):
    for item in rec["prompts"]:
        n = len(item["rounds_detail"]["emitted"])
        item["rounds_detail"]["phase_host_ms"] = {p: [ms] * n for p, ms in host.items()}
    return rec


def test_the_report_shows_host_time_against_each_phase_and_skips_records_without_it():
    new = _with_host(_record("ngram", phase_ms={"verify": 4.0, "draft": 1.0}), {"verify": 1.0, "draft": 1.0})
    old = _record("eagle3", phase_ms={"verify": 6.0, "draft": 0.5})
    old["cell_id"] = "llama__eagle3__old"
    records = [(None, new), (None, old)]
    text = "\n".join(host_section(records, profiles(records)))
    assert "### Host time before each barrier" in text
    row = next(line for line in text.splitlines() if "| ngram" in line)
    assert "1.00 / 1.00" in row and "1.00 / 4.00" in row and "2.00 / 5.00" in row and "40%" in row
    assert "eagle3" not in text  # its record predates the split
    assert host_section([(None, old)], profiles([(None, old)])) == []
    assert profiles(records, "phase_host_ms")["verify"].tolist() == pytest.approx([1.0])
