"""The report's per-category numbers: computed from the records' per-prompt data, by the
estimators the record's own summary uses, so that code and prose are told apart."""

import csv
import json
import math
import statistics
import subprocess
import sys

import pytest

from report.frames import categories
from report.tables import category_tables
from tests.test_cli import QUICK, REPO, harness


def _item(pid, category, turn, rounds, accepted_at, decode_s, base_decode_s=None, n_tokens=9):
    """One per-prompt record item as measure.py writes it (the fields the report reads);
    each rep generates n_tokens, so a rep's tok/s is (n_tokens - 1) / its decode seconds."""
    item = {"id": pid, "category": category, "turn": turn, "n_tokens": n_tokens, "rounds": rounds,
            "drafted": 6, "accepted": sum(accepted_at), "proposed_at": [2, 2, 2], "accepted_at": accepted_at,
            "decode_s": decode_s, "decode_tps": [(n_tokens - 1) / s for s in decode_s]}
    if base_decode_s is not None:
        item["base"] = {"decode_s": base_decode_s, "decode_tps": [(n_tokens - 1) / s for s in base_decode_s]}
    return item


def _record(method, items, status="ok", block_size=3, cid=None):
    return {"cell_id": cid or f"llama__{method}", "status": status, "prompts": items, "model": {"path": "m"},
            "cell": {"arch": {"name": "llama"}, "method": {"name": method, "block_size": block_size},
                     "kv": {"name": "native"}, "reference": None if method == "base" else "base"}}


# prose: one prompt of two turns, nothing accepted; code: two prompts, 10 of 12 drafts accepted.
# 3 reps; in rep 1 the method's code prompts take 0.2 s and 0.1 s for 8 tokens each.
PROSE = [_item("prose-1", "prose", t, rounds=8, accepted_at=[0, 0, 0], decode_s=[0.8, 0.8, 0.8],
               base_decode_s=[0.4, 0.4, 0.4]) for t in (0, 1)]
CODE = [_item("code-1", "code", 0, rounds=2, accepted_at=[2, 2, 2], decode_s=[0.1, 0.2, 0.1],
              base_decode_s=[0.4, 0.5, 0.4]),
        _item("code-2", "code", 0, rounds=4, accepted_at=[2, 1, 1], decode_s=[0.1, 0.1, 0.3],
              base_decode_s=[0.4, 0.4, 0.4])]


def _records():
    base = [dict(i, rounds=8, drafted=0, accepted=0, proposed_at=[], accepted_at=[]) for i in PROSE + CODE]
    for i in base:
        del i["base"]
    return [("a.json", _record("ngram", PROSE + CODE)),
            ("b.json", _record("base", base, block_size=None)),
            ("c.json", _record("eagle3", [], status="error"))]


def _row(df, method, category):
    [row] = df[(df["method"] == method) & (df["category"] == category)].to_dict("records")
    return row


def _ci(ratios):
    logs = [math.log(r) for r in ratios]
    t = {3: 4.303, 4: 3.182}[len(logs)]  # t(0.975, df = n - 1), from a table
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(statistics.mean(logs) - half), math.exp(statistics.mean(logs) + half)


def test_code_and_prose_get_their_own_acceptance_tau_and_paired_speedup():
    df = categories(_records())
    assert list(df[df["method"] == "ngram"]["category"]) == ["all", "prose", "code"]  # the suite's order
    assert set(df["method"]) == {"ngram", "base"}  # the cell that did not run has no rows

    code = _row(df, "ngram", "code")
    assert (code["prompts"], code["turns"], code["tokens"]) == (2, 2, 18)
    assert code["tau"] == pytest.approx(16 / 6) and code["acceptance_rate"] == pytest.approx(10 / 12)
    assert code["per_position_acceptance"] == pytest.approx([1.0, 0.75, 0.75])
    # per rep, summed tokens over summed time (rep 1: 16 / 0.3 s), not the mean of per-prompt rates (60)
    method_reps, base_reps = [16 / 0.2, 16 / 0.3, 16 / 0.4], [16 / 0.8, 16 / 0.9, 16 / 0.8]
    assert code["decode_tps"] == pytest.approx(16 / 0.3) and code["base_decode_tps"] == pytest.approx(20.0)
    # the geometric mean of the paired per-rep ratios (4, 3, 2): 24^(1/3), neither their median (3), their
    # mean nor the ratio of medians (2.67)
    ratios = [m / b for m, b in zip(method_reps, base_reps)]
    assert ratios == pytest.approx([4.0, 3.0, 2.0]) and code["speedup"] == pytest.approx(24 ** (1 / 3))
    assert code["speedup_ci_low"] < code["speedup"] < code["speedup_ci_high"]
    assert code["ratio_of_medians"] == pytest.approx((16 / 0.3) / 20)
    assert (code["speedup_ci_low"], code["speedup_ci_high"]) == pytest.approx(_ci(ratios))

    prose = _row(df, "ngram", "prose")
    assert (prose["prompts"], prose["turns"]) == (1, 2)
    assert prose["tau"] == pytest.approx(1.0) and prose["acceptance_rate"] == 0.0
    assert prose["decode_tps"] == pytest.approx(10.0) and prose["speedup"] == pytest.approx(0.5)

    every = _row(df, "ngram", "all")  # the whole cell by the same estimators
    ratios = [(32 / 1.8) / (32 / 1.6), (32 / 1.9) / (32 / 1.7), (32 / 2.0) / (32 / 1.6)]
    assert every["speedup"] == pytest.approx(math.exp(statistics.mean(math.log(r) for r in ratios)))
    # over prompts: each turn's geometric-mean ratio over its reps (prose 0.5 twice; code-1 4, 2.5, 4;
    # code-2 4, 4, 4/3), then their geometric mean and its t-interval over the 4 turns
    per_prompt = [0.5, 0.5, (4 * 2.5 * 4) ** (1 / 3), (4 * 4 * 4 / 3) ** (1 / 3)]
    assert every["speedup_prompts"] == pytest.approx(math.exp(statistics.mean(math.log(r) for r in per_prompt)))
    assert (every["speedup_prompts_ci_low"], every["speedup_prompts_ci_high"]) == pytest.approx(_ci(per_prompt))
    assert every["acceptance_rate"] == pytest.approx(10 / 24) and every["tau"] == pytest.approx(32 / 22)

    base = _row(df, "base", "code")  # its own reference: no pairing
    assert base["speedup"] == 1.0 and base["base_decode_tps"] == base["decode_tps"]
    assert math.isnan(base["acceptance_rate"]) and base["tau"] == 1.0


def _table(md: str, title: str) -> dict[str, dict[str, str]]:
    # method -> {column: cell} of the markdown table under `title`
    lines = md.split(title + ":\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]
    return {r["method"]: r for r in rows}


def test_the_category_tables_put_each_number_under_its_category():
    md = category_tables(categories(_records()))
    assert "Prompts/turns per cell: all 3/4, prose 1/2, code 2/2." in md
    speed = _table(md, "Speedup vs the reference arm [95% CI]")
    assert list(speed["ngram"]) == ["method", "block", "kv", "all", "prose", "code"]
    lo, hi = _ci([4.0, 3.0, 2.0])
    assert speed["ngram"]["code"] == f"{24 ** (1 / 3):.3f}x [{lo:.3f}, {hi:.3f}]"
    assert speed["ngram"]["prose"].startswith("0.500x") and speed["base"]["prose"] == "1.000x"
    assert _table(md, "Acceptance (accepted / drafted)")["ngram"] == {
        "method": "ngram", "block": "3", "kv": "native", "all": "41.7%", "prose": "0.0%", "code": "83.3%"}
    assert _table(md, "tau (tokens per verify)")["ngram"]["code"] == "2.67"
    assert _table(md, "tok/s, reference / method")["ngram"]["prose"] == "20.0 / 10.0"


def test_a_real_run_reports_categories_whose_all_row_is_the_record_summary(tmp_path):
    out = tmp_path / "run"
    r = harness("arch=llama", "method=ngram", "method.block_size=3", *QUICK, "bench.max_prompts=null",
                "bench.per_category=1", "bench.categories=[code,multi_turn]", "bench.reps=2", f"out_dir={out}")
    assert r.returncode == 0, r.stderr
    [path] = out.glob("*.json")
    rec = json.loads(path.read_text())
    [source] = rec["suite"]  # the record names the prompt file it read
    assert source["spec"] == "builtin" and source["path"].endswith("harness/data/prompts.jsonl")
    rep = subprocess.run([sys.executable, "-m", "report", str(out)], cwd=REPO, capture_output=True, text=True)
    assert rep.returncode == 0, rep.stderr
    rows = {row["category"]: row for row in csv.DictReader((out / "categories.csv").open())}
    assert list(rows) == ["all", "code", "multi_turn"]
    assert (rows["multi_turn"]["prompts"], rows["multi_turn"]["turns"]) == ("1", "2")
    s = rec["summary"]
    for key in ("decode_tps", "base_decode_tps", "speedup", "speedup_ci_low", "speedup_ci_high", "ratio_of_medians",
                "tau", "acceptance_rate"):
        assert float(rows["all"][key]) == pytest.approx(s[key], rel=1e-9), key
    code = [i for i in rec["prompts"] if i["category"] == "code"]
    assert float(rows["code"]["tau"]) == pytest.approx(code[0]["tau"])
    md = (out / "report.md").read_text()
    assert "## Results by prompt category" in md and "| all " in md and "multi_turn" in md
    assert "Prompt files: `builtin`" in md


def test_a_cell_refused_before_its_model_loaded_shares_its_arch_table_with_the_reason_in_place():
    import pandas as pd

    from report.frames import arch_labels
    from report.tables import cell_table

    ok = {"cell_id": "a", "cell": {"arch": {"name": "smollm2"}}, "model": {"path": "/c/x-float32", "dtype": "float32"}}
    refused = {"cell_id": "b", "cell": {"arch": {"name": "smollm2"}}, "status": "unsupported"}  # no "model"
    labels = arch_labels([(None, ok), (None, refused)])
    assert labels == {"a": "smollm2", "b": "smollm2"}
    df = pd.DataFrame([{"method": "dflash_a", "block_size": None, "kv": "native", "status": "unsupported",
                        "reason": "no dflash drafter"}])
    header, _, row = cell_table(df).strip().splitlines()[:3]
    cols = [c.strip() for c in row.strip("|").split("|")]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert names[0] == "method" and names[-1] == "diverged" and len(cols) == len(names)
    assert cols[0] == "dflash_a" and cols[-1] == "unsupported: no dflash drafter"


def test_a_cell_mixing_suites_gets_one_pooled_row_per_suite():
    """`bench.suite=humaneval+repeat`: a suite's pooled interval is its own row (`suite repeat`), the
    same estimators over that suite's prompts alone; a cell of one suite gets none."""
    prose = [dict(i, suite="chat") for i in PROSE]
    code = [dict(i, suite="repeat") for i in CODE]
    df = categories([("a.json", _record("ngram", prose + code))])
    assert list(df["category"]) == ["all", "suite chat", "suite repeat", "prose", "code"]
    pooled, code_row = _row(df, "ngram", "suite repeat"), _row(df, "ngram", "code")
    for key in ("speedup", "speedup_ci_low", "speedup_ci_high", "tau", "decode_tps"):
        assert pooled[key] == pytest.approx(code_row[key]), key  # the suite holds exactly the code prompts
    assert _row(df, "ngram", "suite chat")["speedup"] == pytest.approx(_row(df, "ngram", "prose")["speedup"])
    assert "suite" not in " ".join(categories(_records())["category"])  # one suite: no suite rows
    assert list(_table(category_tables(df), "tau (tokens per verify)")["ngram"]) == [
        "method", "block", "kv", "all", "suite chat", "suite repeat", "prose", "code"]
