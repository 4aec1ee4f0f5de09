"""The fixtures' training text holds no benchmark prompt, so fixture acceptance is measured on held-out text."""

import re
from importlib import metadata
from pathlib import Path

import pytest

from harness.models import fixtures
from harness.prompts import PACKAGED, load_suite

WINDOW = 12  # words: longer than any phrase two unrelated texts share by chance, shorter than any pasted prompt


def _words(text: str) -> list[str]:
    # Case, punctuation, whitespace and markup do not hide a paste: compare runs of letters and digits.
    return re.findall(r"[a-z0-9]+", text.lower())


def leaked_turns(corpus: str, turns: list[str], window: int = WINDOW) -> list[str]:
    """The turns that share a `window`-word run with `corpus`; a turn shorter than that leaks
    when all of it appears there."""
    words = _words(corpus)
    grams = {tuple(words[i: i + window]) for i in range(len(words) - window + 1)}
    joined = f" {' '.join(words)} "
    leaked = []
    for turn in turns:
        w = _words(turn)
        if len(w) < window:
            hit = bool(w) and f" {' '.join(w)} " in joined
        else:
            hit = any(tuple(w[i: i + window]) in grams for i in range(len(w) - window + 1))
        if hit:
            leaked.append(turn)
    return leaked


def _turns(suite: str) -> list[str]:
    if suite in PACKAGED:
        try:
            metadata.distribution(PACKAGED[suite].distribution)
        except metadata.PackageNotFoundError:
            pytest.skip(f"{PACKAGED[suite].distribution} is not installed ({PACKAGED[suite].install_line()})")
    return [t for p in load_suite(suite) for t in p.turns]


@pytest.mark.parametrize("suite", ["builtin", "mtbench", "humaneval"])
def test_no_benchmark_prompt_appears_in_the_fixture_training_text(suite):
    leaked = leaked_turns(fixtures.corpus_text(), _turns(suite))
    assert not leaked, (f"{len(leaked)} {suite} prompt turns appear in the fixture corpus (harness/data/corpus.txt), "
                        f"e.g. {leaked[0][:80]!r}: remove them there and retrain (python -m train.fixtures)")


def test_the_leak_check_catches_a_pasted_prompt_however_it_is_formatted():
    turns = _turns("builtin")
    corpus = "The tide comes in twice a day. Bake the loaf in a hot covered pot for forty minutes."
    assert leaked_turns(corpus, turns) == []
    long_turn = max(turns, key=len)
    middle = " ".join(long_turn.split()[10: 10 + WINDOW + 2])  # a fragment from inside the turn
    assert leaked_turns(corpus + "\n" + middle.upper().replace(" ", "  ,"), turns) == [long_turn]
    short = "Translate into Klingon: good morning."
    assert leaked_turns(corpus + f"\n{short.lower()}\n", [short]) == [short]
    assert leaked_turns(corpus, [short]) == []
    # Text with the suite appended, as the fixtures' corpus once had, leaks every turn.
    assert len(leaked_turns(corpus + "\n".join(turns), turns)) == len(turns)


def test_the_shipped_tokenizer_is_the_one_trained_on_the_held_out_corpus(tmp_path: Path):
    # BPE training is deterministic: a tokenizer.json left over from another corpus would differ.
    fixtures.train_tokenizer_json(tmp_path / "tokenizer.json")
    assert (tmp_path / "tokenizer.json").read_bytes() == (fixtures.SHIPPED_DIR / "tokenizer.json").read_bytes(), \
        "harness/data/fixtures/tokenizer.json was not trained on corpus_text(): delete it and " \
        "run `python -m train.fixtures` (it retrains the tokenizer and every fixture)"


def test_a_scale_preset_built_with_an_older_fixture_tokenizer_is_rebuilt(tmp_path, monkeypatch):
    from harness.models.resolve import resolve_model

    monkeypatch.setenv("SPEC_HARNESS_HOME", str(tmp_path))
    path = resolve_model("scale:llama-tiny")
    (path / "tokenizer.json").write_text("{}")  # as a build from before the tokenizer was retrained
    assert resolve_model("scale:llama-tiny") == path
    assert (path / "tokenizer.json").read_bytes() == (fixtures.SHIPPED_DIR / "tokenizer.json").read_bytes()
