"""The report along the axes users ask about: acceptance by decode depth, speedup by context
length, speedup and acceptance by temperature. Synthetic records only (no MLX): every number
checked here is set by hand in the records, so the report must give it back exactly."""

import json
import subprocess
import sys

import matplotlib.image as mpimg
import pytest

from report import plots
from report.document import write
from report.frames import along, cells, depth, depth_table, prompts, round_positions
from report.tables import arch_tables, context_table, depth_summary_table, divergence_table, temperature_table
from tests.test_cli import REPO

# Prompt A's rounds, positions written by the harness: 4 rounds of 4 tokens from position 1 (bin 0),
# 8 of 2 from 17 (bin 1), 16 of 1 from 33 (positions 33..47 in bin 2, 48 alone in bin 3). K = 3 drafts a
# round, every emitted token but the round's last an accepted draft.
EMITTED_A = [4] * 4 + [2] * 8 + [1] * 16
POSITION_A = [1, 5, 9, 13, *range(17, 33, 2), *range(33, 49)]
DETAIL_A = {"drafted": [3] * 28, "accepted": [e - 1 for e in EMITTED_A], "emitted": EMITTED_A, "ms": [1.0] * 28,
            "position": POSITION_A}
# Prompt B: two rounds of 2 tokens at positions 1 and 3, one draft each, both accepted.
DETAIL_B = {"drafted": [1, 1], "accepted": [1, 1], "emitted": [2, 2], "ms": [1.0, 1.0], "position": [1, 3]}

DETAIL_BASE = {"drafted": [0] * 48, "accepted": [0] * 48, "emitted": [1] * 48, "ms": [1.0] * 48}


def test_the_depth_table_is_what_the_rounds_imply():
    rows = depth_table([DETAIL_A, DETAIL_B], width=16)
    got = [(r["depth_lo"], r["depth_hi"], r["rounds"], r["emitted"], r["drafted"], r["accepted"]) for r in rows]
    assert got == [(0, 15, 4 + 2, 16 + 4, 12 + 2, 12 + 2),  # A's 4-token rounds and B's two
                   (16, 31, 8, 16, 24, 8),
                   (32, 47, 15, 15, 45, 0),
                   (48, 63, 1, 1, 3, 0)]  # one round, still shown, with its count
    assert [r["tau"] for r in rows] == pytest.approx([20 / 6, 2.0, 1.0, 1.0])
    assert [r["acceptance_rate"] for r in rows] == pytest.approx([1.0, 1 / 3, 0.0, 0.0])
    # a wider bin pools them: 0..31 and 32..63
    assert [(r["rounds"], r["emitted"]) for r in depth_table([DETAIL_A, DETAIL_B], width=32)] == [(14, 36), (16, 16)]
    assert depth_table([{"drafted": [0], "accepted": [0], "emitted": [1], "ms": [1.0]}])[0]["acceptance_rate"] is None


def test_positions_fall_back_to_one_plus_the_tokens_earlier_rounds_emitted():
    without = {k: v for k, v in DETAIL_A.items() if k != "position"}  # a record written before the column
    assert round_positions(without) == POSITION_A  # token 0 is the prefill's: the first round starts at 1
    assert depth_table([without]) == depth_table([DETAIL_A])
    assert round_positions({"emitted": [3, 1], "position": [5, 9]}) == [5, 9]  # the written column wins
    # 64 one-token rounds: positions 1..64, so 15 rounds in the first bin, 16 in the next three, 1 in the last
    ones = {"drafted": [2] * 64, "accepted": [0] * 64, "emitted": [1] * 64, "ms": [1.0] * 64}
    assert [r["rounds"] for r in depth_table([ones], width=16)] == [15, 16, 16, 16, 1]


def _item(pid, detail, diverged_at=None, context_tokens=None, phase_ms=None):
    """A per-prompt record item with the fields the report reads (measure.py's shape)."""
    detail = dict(detail)
    if phase_ms:
        detail["phase_ms"] = {p: [ms] * len(detail["emitted"]) for p, ms in phase_ms.items()}
    n = 1 + sum(detail["emitted"])
    drafted, accepted = sum(detail["drafted"]), sum(detail["accepted"])
    k = max(detail["drafted"], default=0)
    item = {"id": pid, "category": "writing", "suite": "mtbench", "turn": 0, "n_tokens": n,
            "rounds": len(detail["emitted"]), "drafted": drafted, "accepted": accepted,
            "accept_hist": [sum(a == j for a in detail["accepted"]) for j in range(k + 1)],
            "proposed_at": [sum(d > j for d in detail["drafted"]) for j in range(k)],
            "accepted_at": [sum(a > j for a in detail["accepted"]) for j in range(k)],
            "decode_s": [0.5, 0.5, 0.5], "decode_tps": [(n - 1) / 0.5] * 3,
            "base": {"decode_s": [1.0, 1.0, 1.0], "decode_tps": [(n - 1) / 1.0] * 3},
            "first_divergence": diverged_at, "matched_fraction": 1.0 if diverged_at is None else diverged_at / n,
            "rounds_detail": detail}
    if context_tokens is not None:
        item["context_tokens"] = context_tokens
    return item


def _record(method, context=0, temperature=0.0, speedup=1.5, ci=(1.2, 1.8), diverged_at=None,
            phase_ms=None, block_size=4):
    """A record as the harness writes one (the fields the report reads), at bench.context /
    bench.temperature; context 0 leaves both the bench key and the context fields out, as an
    older record would."""
    bench = {"suite": "mtbench", "max_new_tokens": 64, "reps": 3, "temperature": temperature, "seed": 0}
    held = None
    if context:  # the harness writes both keys only where there is a context
        bench.update(context=context, context_source="sharegpt")
        held = context - 7  # the source ran short of a whole turn: what the prompts really held
    base = method == "base"
    items = [_item("81", DETAIL_A, diverged_at, held, phase_ms), _item("82", DETAIL_B, None, held, phase_ms)]
    if base:  # one token a round, no drafts, no reference arm
        items = [_item(pid, DETAIL_BASE, None, held, phase_ms) for pid in ("81", "82")]
        for i in items:
            del i["base"]
    cell = {"arch": {"name": "llama"}, "method": {"name": method, "block_size": None if base else block_size},
            "kv": {"name": "native"}, "bench": bench, "reference": None if base else "base"}
    summary = {"decode_tps": 60.0, "base_decode_tps": 40.0, "speedup": 1.0 if base else speedup,
               "speedup_ci_low": None if base else ci[0], "speedup_ci_high": None if base else ci[1],
               "tau": 2.0, "acceptance_rate": None if base else 0.4, "prompts": 2,
               "diverged_prompts": int(diverged_at is not None), "earliest_divergence": diverged_at,
               "ttft_ms": 10.0 + context / 100, "base_ttft_ms": 9.0 + context / 100}
    rec = {"schema": 1, "cell_id": f"llama__{method}__c{context}__t{temperature}", "status": "ok", "config": {},
           "cell": cell, "model": {"path": "m", "dtype": "float32", "model_type": "llama"},
           "env": {"git": {"sha": "0" * 40, "dirty": False}, "backend": "cpu"},
           "started_at": "2026-12-05T00:00:00+00:00", "prompts": items, "summary": summary}
    if context:
        rec["context"] = {"requested": context, "source": "sharegpt-sample.jsonl", "sha256": "ab" * 32,
                          "tokens": held}
    return rec


CONTEXTS = (0, 512, 4096)


def _context_records():
    # ngram and eagle3 at three context lengths, speedup falling with context; base decoding at each.
    out = []
    for c in CONTEXTS:
        out.append((None, _record("ngram", c, speedup=1.5 - c / 10_000, ci=(1.1, 1.9),
                                  phase_ms={"verify": 2.0 + c / 1000, "draft": 0.1})))
        out.append((None, _record("eagle3", c, speedup=2.0 - c / 10_000, ci=(1.8, 2.2),
                                  phase_ms={"verify": 2.0 + c / 1000, "draft": 0.5, "context_pass": c / 2000})))
        out.append((None, _record("base", c, phase_ms={"verify": 1.0 + c / 2000})))
    return out


def test_the_context_axis_has_one_row_per_method_and_context_and_one_line_each_in_its_plot(tmp_path, monkeypatch):
    records = _context_records()
    ax = along(records, "context")
    assert sorted(zip(ax["method"], ax["context"])) == sorted((m, c) for m in ("base", "eagle3", "ngram")
                                                              for c in CONTEXTS)  # names without "(context=...)"
    row = ax[(ax["method"] == "eagle3") & (ax["context"] == 4096)].iloc[0]
    assert (row["speedup"], row["speedup_ci_low"], row["speedup_ci_high"]) == pytest.approx((2.0 - 0.4096, 1.8, 2.2))
    assert (row["ms verify"], row["ms draft"], row["ms context_pass"]) == pytest.approx((6.096, 0.5, 2.048))
    assert row["context_tokens"] == 4096 - 7
    assert ax[ax["context"] == 0]["context_tokens"].isna().all()  # an older record holds no context

    table = context_table(ax)
    lines = [ln for ln in table.splitlines() if ln.startswith("| llama")]
    assert len(lines) == 9
    eagle = next(ln for ln in lines if "| eagle3" in ln and "| 4096 " in ln)
    assert "1.590x [1.800, 2.200]" in eagle and "verify 6.10, context_pass 2.05, draft 0.50" in eagle

    drawn, bands = {}, {}
    real_plot, real_band = plots.plt.Axes.plot, plots.plt.Axes.fill_between
    monkeypatch.setattr(plots.plt.Axes, "plot", lambda a, x, y, *args, **kw: drawn.setdefault(
        kw.get("label"), (list(x), list(y))) and real_plot(a, x, y, *args, **kw))
    monkeypatch.setattr(plots.plt.Axes, "fill_between", lambda a, x, lo, hi, **kw: bands.setdefault(
        len(bands), (list(lo), list(hi))) and real_band(a, x, lo, hi, **kw))
    plots.speedup_vs_context(ax, tmp_path / "c.png")
    assert set(drawn) == {"llama eagle3 b4 native", "llama ngram b4 native"}  # base is the reference, no line
    xs, ys = drawn["llama ngram b4 native"]
    assert xs == [0, 512, 4096] and ys == pytest.approx([1.5, 1.4488, 1.0904])
    assert sorted(bands.values()) == [([1.1] * 3, [1.9] * 3), ([1.8] * 3, [2.2] * 3)]


def test_the_depth_frame_names_each_cell_once_with_its_context_in_a_column():
    dep = depth(_context_records())
    ngram = dep[(dep["method"] == "ngram") & (dep["context"] == 512)]
    assert list(ngram["depth_lo"]) == [0, 16, 32, 48] and list(ngram["rounds"]) == [6, 8, 15, 1]  # A and B pooled
    table = depth_summary_table(dep)
    rows = [ln for ln in table.splitlines() if ln.startswith("| llama")]
    assert len(rows) == 6 and not any("| base" in ln for ln in rows)  # base decoding drafts nothing
    headers = [c.strip() for c in table.splitlines()[0].strip("|").split("|")]
    assert "context" in headers and "T" not in headers  # a column only for the axis that varies
    assert "0-15 / 48-63" in rows[0] and "3.33 / 1.00" in rows[0] and "100.0% / 0.0%" in rows[0]


def test_a_sampled_cell_is_labelled_and_its_divergence_is_expected_not_a_bug():
    records = [(None, _record("ngram", temperature=1.0, diverged_at=5)),
               (None, _record("eagle3", temperature=0.0, diverged_at=7))]  # greedy: still a finding
    md = arch_tables(cells(None, records))
    sampled = next(ln for ln in md.splitlines() if ln.startswith("| ngram"))
    greedy = next(ln for ln in md.splitlines() if ln.startswith("| eagle3"))
    assert "ngram (T=1.0, sampled)" in sampled and "1/2 (sampled: expected)" in sampled and "first at" not in sampled
    assert "eagle3 (T=0.0)" in greedy and "1/2 (first at 7)" in greedy
    div = {ln.split("|")[2].strip(): ln.split("|")[-2].strip()
           for ln in divergence_table(prompts(None, records)).splitlines()[2:]}
    assert div == {"ngram (T=1.0, sampled)": "sampled: expected", "eagle3 (T=0.0)": "not run"}
    # a run whose every cell samples at one temperature: nothing varies, the label stays
    alone = arch_tables(cells(None, records[:1]))
    assert "| ngram (T=1.0, sampled) " in alone and "1/2 (sampled: expected)" in alone


def test_the_temperature_axis_reads_speedup_and_acceptance_per_method(tmp_path):
    records = [(None, _record(m, temperature=t, speedup=s)) for m in ("ngram", "eagle3")
               for t, s in ((0.0, 1.6), (0.5, 1.3), (1.0, 1.1))]
    ax = along(records, "temperature")
    assert sorted(zip(ax["method"], ax["temperature"])) == sorted((m, t) for m in ("eagle3", "ngram")
                                                                  for t in (0.0, 0.5, 1.0))  # no "(T=...)" in names
    table = temperature_table(ax)
    row = next(ln for ln in table.splitlines() if "| ngram" in ln and "0.5 (sampled)" in ln)
    assert "1.300x [1.200, 1.800]" in row and "40.0%" in row
    assert any("| ngram" in ln and "0.0 (greedy)" in ln for ln in table.splitlines())
    img = mpimg.imread(plots.speedup_vs_temperature(ax, tmp_path / "t.png"))
    assert img.std() > 0.01


def _write(root, records):
    root.mkdir(parents=True, exist_ok=True)
    for _, rec in records:
        (root / f"{rec['cell_id']}.json").write_text(json.dumps(rec))


def _section(md: str, title: str) -> str:
    return md.split(title + "\n", 1)[1].split("\n#", 1)[0]


def test_the_report_of_a_run_along_context_and_temperature_writes_the_axes_sections_beside_their_plots(tmp_path):
    records = _context_records() + [(None, _record("ngram", temperature=t, diverged_at=5)) for t in (0.7, 1.0)]
    _write(tmp_path, records)
    rep = subprocess.run([sys.executable, "-m", "report", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert rep.returncode == 0, rep.stderr
    md = (tmp_path / "report.md").read_text()
    assert "## Axes" in md
    for title, png in (("### Acceptance by decode depth", "tau_by_depth"), ("### Context length", "speedup_vs_context"),
                       ("### Temperature", "speedup_vs_temperature")):
        section = _section(md, title)
        assert "|" in section and f"![{png}]({png}.png)" in section, title  # the plot beside its table
        img = mpimg.imread(tmp_path / f"{png}.png")
        assert img.std() > 0.01, f"{png}.png is blank"
    assert (tmp_path / "depth.csv").stat().st_size > 100
    assert "sharegpt-sample.jsonl" in md and "not a defect" in _section(md, "### Temperature")
    assert "(T=1.0, sampled)" in md and "1/2 (sampled: expected)" in md


def test_a_run_with_one_context_and_one_temperature_has_only_the_depth_section(tmp_path):
    _write(tmp_path, [(None, _record("ngram")), (None, _record("base"))])
    write(tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "### Acceptance by decode depth" in md and (tmp_path / "tau_by_depth.png").exists()
    assert "### Context length" not in md and "### Temperature" not in md
    assert not (tmp_path / "speedup_vs_context.png").exists() and not (tmp_path / "speedup_vs_temperature.png").exists()
    assert "sampled" not in md.split("## Divergence")[0]  # greedy cells carry no temperature label


def test_the_context_table_splits_the_first_token_into_prefill_and_the_drafters_context_pass():
    records = _context_records()
    for _, rec in records:  # profiled first tokens on two prompts: prepare grows with the context
        c = rec["cell"]["bench"].get("context", 0)
        for j, item in enumerate(rec["prompts"][:2]):
            item["first_token"] = {"prefill": 10.0 + j, "prepare": c / 100 + 2 * j}
    ax = along(records, "context")
    row = ax[(ax["method"] == "eagle3") & (ax["context"] == 4096)].iloc[0]
    assert (row["first_prefill_ms"], row["first_prepare_ms"]) == pytest.approx((10.5, 40.96 + 1.0))
    line = next(ln for ln in context_table(ax).splitlines() if "| eagle3" in ln and "| 4096 " in ln)
    assert [c.strip() for c in line.split("|")][-4:-2] == ["10.5", "42.0"]
