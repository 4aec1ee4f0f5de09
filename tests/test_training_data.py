"""Training data at scale: ShareGPT read from a file cut short, answers generated in full
batches equal to one-by-one greedy answers, a data cache packed into one file and back, and
GSM8K as a held-out suite."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from harness.errors import ConfigError
from harness import sharegpt as harness_sharegpt
from train import sharegpt
from train.data import normalise


def _conversation(i: int, first: str, text: str) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": first, "value": text}, {"from": "gpt", "value": "ok " * 5}]}


def _cut_file(path: Path, convs: list[dict], cut_inside_last: bool = True) -> None:
    """A JSON array of `convs` written the way the packaged file is: indented, and (by default)
    cut short in the middle of the last conversation."""
    text = json.dumps(convs, indent=2)
    if cut_inside_last:  # a little past the last conversation's id
        text = text[: text.rindex(f'"id": "{convs[-1]["id"]}"') + 40]
    path.write_text(text)


def test_sharegpt_reader_recovers_whole_conversations_from_a_file_cut_short(tmp_path, monkeypatch):
    monkeypatch.setattr(harness_sharegpt, "CHUNK", 64)  # elements span many reads
    convs = [_conversation(0, "human", "How do I sort a list in Python?"),
             _conversation(1, "gpt", "A model speaking first is not a user's prompt"),
             _conversation(2, "human", "  "),  # empty
             _conversation(3, "human", "how do I SORT a list   in python?"),  # a repeat after normalising
             _conversation(4, "human", "Explain the \"quoted\" word, and a ] bracket, and {braces}."),
             _conversation(5, "human", "This conversation is cut in half by the end of the file")]
    path = tmp_path / "share.json"
    _cut_file(path, convs)
    got = sharegpt.first_human_turns(path, normalise)
    assert got.prompts == ["How do I sort a list in Python?", "Explain the \"quoted\" word, and a ] bracket, and {braces}."]
    assert (got.conversations, got.human_first, got.truncated) == (5, 4, True)
    _cut_file(path, convs, cut_inside_last=False)  # a whole file: every conversation, not cut
    whole = sharegpt.first_human_turns(path, normalise)
    assert whole.conversations == 6 and not whole.truncated and whole.prompts[-1].startswith("This conversation")
    path.write_text('{"not": "an array"}')
    with pytest.raises(ConfigError, match="not a ShareGPT file"):
        sharegpt.first_human_turns(path, normalise)


def test_sharegpt_prompts_drop_overlap_and_over_long_ones_and_count_them(tmp_path, monkeypatch):
    from harness.models import packaged
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train import data
    from train.data import eval_texts

    texts, _ = eval_texts()
    gsm = texts["gsm8k"][0]
    convs = [_conversation(i, "human", f"Question number {i}: what is {i} plus {i}?") for i in range(12)]
    convs += [_conversation(90, "human", gsm), _conversation(91, "human", "word " * 400)]
    path = tmp_path / "share.json"
    _cut_file(path, convs + [_conversation(99, "human", "cut")])
    real = packaged.find
    monkeypatch.setattr(packaged, "find", lambda pkg, setting: (path, "test") if pkg is sharegpt.PACKAGE
                        else real(pkg, setting))  # the evaluation suites stay the installed ones
    model, tok = load_target(resolve_model("fixture:llama", "float32"), "float32")
    cfg = SimpleNamespace(n_prompts=100, seed=0, max_prompt_tokens=None, max_len=128, max_new_tokens=32)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "manifest.json").write_text("{}")
    prompts = data._sharegpt_prompts(tok, cfg, tmp_path / "cache", lambda m: None)
    assert len(prompts) == 12 and gsm not in prompts and not any(p.startswith("word") for p in prompts)
    filtered = json.loads((tmp_path / "cache" / "manifest.json").read_text())["filtered"]
    assert filtered["dropped_overlap"]["gsm8k"] == 1 and filtered["dropped_over_max_prompt_tokens"] == 1
    assert filtered["truncated_file"] and filtered["max_prompt_tokens"] == 96 and filtered["kept"] == 12


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_batched_answers_equal_one_by_one_greedy_answers_in_float32(arch):
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train.data import _encode_prompt, answer_batch

    model, tok = load_target(resolve_model(f"fixture:{arch}", "float32"), "float32")
    texts = ["Hello there, how are you?", "Write a poem about the sea, the sky and every fish in it, please.", "x",
             "Explain quicksort to a child who likes cards.", "Why is the sky blue?", "List three prime numbers."]
    ids = sorted((_encode_prompt(tok, t) for t in texts), key=len)  # lengths differ: the batch pads
    assert len({len(i) for i in ids}) > 3
    cfg = SimpleNamespace(max_new_tokens=24, temperature=0.0, top_p=1.0, batch=len(ids))
    batched = answer_batch(model, tok, ids, cfg, seed=0)
    alone = [answer_batch(model, tok, [p], cfg, seed=0)[0] for p in ids]
    assert batched == alone and all(len(a) == 24 for a in batched)


def test_rows_that_end_give_their_place_to_the_next_prompts_and_answers_stay_one_by_one(monkeypatch):
    # 6 prompts through 3 rows, answers ending at different steps: rows leave the batch and new
    # prompts are prefilled beside rows in mid-answer; each answer equals its greedy answer alone.
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train import batch_decode

    monkeypatch.setattr(batch_decode, "CHECK_EVERY", 3)
    model, tok = load_target(resolve_model("fixture:llama", "float32"), "float32")
    ids = [tok.encode(t) for t in ["Hello there", "a much longer prompt than the first one, with words", "x y",
                                   "Why is the sky blue?", "one two three four five six seven", "List"]]
    greedy = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    free = [batch_decode.decode(model, [p], 20, set(), greedy) for p in ids]
    eos = {free[0][0][4], free[3][0][10]}  # rows 0 and 3 end early, the others run to the budget or stop elsewhere
    alone = [batch_decode.decode(model, [p], 20, eos, greedy)[0] for p in ids]
    assert len({len(a) for a in alone}) > 1, "the answers must end at different steps for rows to be replaced"
    calls = []
    real = batch_decode._admit
    monkeypatch.setattr(batch_decode, "_admit", lambda m, ps, *a: calls.append(len(ps)) or real(m, ps, *a))
    assert batch_decode.decode(model, ids, 20, eos, greedy, width=3, admit=1) == alone
    assert calls[0] == 3 and len(calls) > 2  # new prompts joined a batch with rows still answering


def test_a_packed_cache_unpacks_to_the_same_shards(tmp_path):
    from train.pack import pack, unpack

    cache = tmp_path / "cache"
    cache.mkdir()
    rows = [[{"prompt_ids": [1, 2, 3], "answer_ids": [70000, 5]}, {"prompt_ids": [9], "answer_ids": []}],
            [{"prompt_ids": [4, 4], "answer_ids": [6, 7, 8]}]]
    for s, shard in enumerate(rows):
        (cache / f"shard-{s:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shard))
    (cache / "manifest.json").write_text(json.dumps({"layout": 2, "n_prompts": 3}))
    (cache / "prompts.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    info = pack(cache, tmp_path / "d.npz")
    assert info["rows"] == 3 and info["tokens"] == 11
    unpack(tmp_path / "d.npz", tmp_path / "back")
    for f in cache.iterdir():
        if f.name != "manifest.json":
            assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes(), f.name
    assert json.loads((tmp_path / "back" / "manifest.json").read_text()) == {"layout": 2, "n_prompts": 3}
    unpack(tmp_path / "d.npz", tmp_path / "back")  # into the same data again: nothing to do
    (tmp_path / "back" / "shard-00001.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="holds other data"):
        unpack(tmp_path / "d.npz", tmp_path / "back")


def test_a_cache_packed_with_a_shard_size_unpacks_into_shards_of_data_batch_rows(tmp_path):
    from train.pack import pack, unpack

    cache = tmp_path / "cache"
    cache.mkdir()
    rows = [{"prompt_ids": [7] * n, "answer_ids": [n, n]} for n in range(1, 8)]  # in prompt-length order
    for s, shard in enumerate([rows[:4], rows[4:]]):  # the old layout: shard_size=4 prompts per shard
        (cache / f"shard-{s:05d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shard))
    (cache / "manifest.json").write_text(json.dumps({"layout": 2, "batch": 3, "shard_size": 4}))
    pack(cache, tmp_path / "d.npz")
    assert unpack(tmp_path / "d.npz", tmp_path / "back") == {"shards": 3, "rows": 7}
    back = [[json.loads(line) for line in (tmp_path / "back" / f"shard-{s:05d}.jsonl").read_text().splitlines()]
            for s in range(3)]
    assert back == [rows[:3], rows[3:6], rows[6:]]  # shards of data.batch rows, in the same order
    assert json.loads((tmp_path / "back" / "manifest.json").read_text()) == {"layout": 2, "batch": 3}


def test_the_pack_command_packs_unpacks_and_refuses_a_missing_file_in_one_line(tmp_path):
    # jobs/smollm2-drafters.sh runs `python -m train.pack` on the device: a module that parses
    # nothing exits 0 and leaves the trainer no data (76f7b47 lost its main this way).
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "train.pack", *map(str, args)], cwd=REPO,
                              capture_output=True, text=True, env=subprocess_env())

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "shard-00000.jsonl").write_text(json.dumps({"prompt_ids": [1, 2], "answer_ids": [3]}) + "\n")
    (cache / "manifest.json").write_text(json.dumps({"layout": 2}))
    r = cli(cache, tmp_path / "d.npz")
    assert r.returncode == 0 and json.loads(r.stdout)["rows"] == 1, r.stderr
    r = cli("--unpack", tmp_path / "d.npz", tmp_path / "back")
    assert r.returncode == 0 and json.loads(r.stdout) == {"shards": 1, "rows": 1}, r.stderr
    assert (tmp_path / "back" / "shard-00000.jsonl").read_bytes() == (cache / "shard-00000.jsonl").read_bytes()
    r = cli("--unpack", tmp_path / "missing.npz", tmp_path / "other")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1


def test_gsm8k_is_a_held_out_suite_whose_math_is_told_apart_from_mt_benchs():
    from harness.prompts import load_suite
    from report.frames import category_labels

    gsm = load_suite("gsm8k")
    assert len(gsm) == 1319 and {p.category for p in gsm} == {"math"} and gsm[0].id == "gsm8k-1"
    assert gsm[0].turns[0].startswith("Janet") and all(len(p.turns) == 1 for p in gsm)
    mixed = load_suite("mtbench+gsm8k", categories=["math"], per_category=2)
    assert [(p.suite, p.category) for p in mixed] == [("mtbench", "math")] * 2 + [("gsm8k", "math")] * 2
    label = category_labels([{"category": p.category, "suite": p.suite} for p in mixed])
    assert [label({"category": p.category, "suite": p.suite}) for p in mixed[1:3]] == ["mtbench:math", "gsm8k:math"]
    assert category_labels([{"category": "math", "suite": "gsm8k"}])({"category": "math", "suite": "gsm8k"}) == "math"


def test_a_data_cache_moved_to_another_harness_home_is_reused_and_another_target_refused():
    from train.data import settings_differ

    made = {"layout": 2, "target": "/root/.cache/spec-harness/gguf/SmolLM2-Q4_1-b179c9-bfloat16-v1",
            "target_config_sha256": "e6", "n_prompts": 8, "generation": {"answer_tokens": 5}}
    # the device's harness home: the converted checkpoint's folder elsewhere, its name the same
    there = {**made, "target": "/tmp/shh/gguf/SmolLM2-Q4_1-b179c9-bfloat16-v1"}
    del there["generation"]
    assert settings_differ(made, there) == []
    assert settings_differ(made, {**there, "target": "/tmp/shh/gguf/SmolLM2-Q4_1-b179c9-float32-v1"}) == ["target"]
    assert settings_differ(made, {**there, "n_prompts": 9, "target_config_sha256": "f0"}) == [
        "n_prompts", "target_config_sha256"]
