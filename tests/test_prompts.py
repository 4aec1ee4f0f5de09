
import pytest

from harness.config import ConfigError
from harness.prompts import load_suite
from tests.conftest import write_jsonl


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
    with pytest.raises(ConfigError, match="cannot be read"):
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
