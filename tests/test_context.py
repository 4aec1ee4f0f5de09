"""The context axis (bench.context): earlier conversation before every prompt, the same ids for
every arm and rep, cut to the size asked, and refused in one line where it cannot fit."""

import json
import random

import pytest

import harness.measure as measure
from harness import context as contexts
from harness.config import BenchConfig
from harness.errors import ConfigError
from harness.measure import Arms, measure_cell
from harness.prompts import Prompt, encode_turn
from tests.conftest import builtin_prompts, method_cfg
from tests.helpers import base_engine
from tests.test_cli import QUICK, harness

WORDS = ("the cache holds every key and value the model has read so far while a drafter guesses what "
         "comes next and the target checks its guesses in one pass then keeps the longest prefix").split()


def write_conversations(path, n: int, words: int = 120, seed: int = 0):
    """n ShareGPT-format conversations (one per line), each two human/gpt pairs of `words` words."""
    rng = random.Random(seed)

    def text():
        return " ".join(rng.choice(WORDS) for _ in range(words)) + "."

    with open(path, "w") as f:
        for i in range(n):
            turns = [{"from": r, "value": text()} for r in ("human", "gpt", "human", "gpt")]
            f.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    return path


@pytest.mark.parametrize("tokens", [40, 333, 1000])
def test_the_context_holds_the_tokens_asked_for_or_a_few_under(models, tmp_path, tokens):
    _, tok = models["llama"]
    src = write_conversations(tmp_path / "convs.jsonl", 20)
    ctx = contexts.build(tok, tokens, str(src), chat_template=True)
    got = contexts.counter(tok, True)(list(ctx.messages))
    assert tokens - 8 <= got <= tokens, got
    roles = [m["role"] for m in ctx.messages]
    assert roles == ["user", "assistant"] * (len(roles) // 2)  # templates that insist on alternation accept it


def test_no_context_is_none_and_a_source_too_short_is_refused(models, tmp_path):
    _, tok = models["llama"]
    src = write_conversations(tmp_path / "convs.jsonl", 1, words=10)
    assert contexts.build(tok, 0, str(src), True) is None
    with pytest.raises(ConfigError, match="holds only"):
        contexts.build(tok, 5000, str(src), True)
    with pytest.raises(ConfigError, match="neither"):
        contexts.build(tok, 10, str(tmp_path / "missing.jsonl"), True)


def test_the_context_sits_between_the_system_turn_and_the_prompt_unchanged(models, tmp_path):
    _, tok = models["llama"]
    ctx = contexts.build(tok, 200, str(write_conversations(tmp_path / "c.jsonl", 5)), True)
    p = Prompt("x", "c", ("What is a cache?", "And a drafter?"))
    full = encode_turn(tok, p, 1, ["An answer."], True, ctx.messages)
    bare = encode_turn(tok, p, 1, ["An answer."], True)
    start, end = contexts.span(full, bare)
    assert full[:start] + full[end:] == bare and end - start == len(full) - len(bare)
    with pytest.raises(ConfigError, match="not its ids without it"):
        contexts.span(full[:-1] + [full[-1] + 1], bare)


def test_the_context_prefix_is_the_same_token_ids_for_both_arms_and_every_rep(models, tmp_path, monkeypatch):
    from engines.methods.ngram import Ngram
    from engines.runtime.target import Target

    model, tok = models["llama"]
    seen = []  # (engine, prompt ids) of every generation the cell runs
    real = measure.run_generation
    monkeypatch.setattr(measure, "run_generation", lambda eng, ids, *a, **k: seen.append((eng.name, list(ids)))
                        or real(eng, ids, *a, **k))
    src = write_conversations(tmp_path / "c.jsonl", 10)
    bench = BenchConfig(max_new_tokens=8, warmup=1, warmup_scope="first", reps=2, profile=True, context=150,
                        context_source=str(src))
    arms = Arms(Ngram(Target(model), method_cfg(block_size=3)), base_engine(model), 3)
    prompts = builtin_prompts()[:2]
    out = measure_cell(arms, tok, prompts, bench)
    ctx = contexts.build(tok, 150, str(src), True)
    for p, item in zip(prompts, out["prompts"]):
        bare = encode_turn(tok, p, 0, [], True)
        runs = [ids for _, ids in seen if len(ids) == item["prompt_tokens"] and ids[-len(bare) + 2:] == bare[-len(bare) + 2:]]
        assert {"ngram", "base"} <= {name for name, ids in seen if ids in runs}
        assert len(runs) >= 2 * bench.reps and all(ids == runs[0] for ids in runs)  # every arm and rep: the same ids
        start, end = contexts.span(runs[0], bare)
        assert runs[0][start:end] == encode_turn(tok, p, 0, [], True, ctx.messages)[start:end]
        assert item["context_tokens"] == end - start and 142 <= end - start <= 150
    assert {i["context_sha256"] for i in out["prompts"]} == {out["context"]["sha256"]}
    assert out["context"]["source"] == str(src) and out["context"]["requested"] == 150


def test_a_context_that_does_not_fit_is_refused_in_one_line_and_leaves_no_record(tmp_path):
    src = write_conversations(tmp_path / "c.jsonl", 60, words=150)
    out = tmp_path / "out"
    r = harness("arch=llama", "method=ngram", *QUICK, "bench.context=4090", f"bench.context_source={src}",
                f"out_dir={out}")
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "bench.context=4090" in errors[0] and "4096" in errors[0], r.stderr
    assert not list(out.glob("*.json"))


def test_a_cell_without_context_keeps_the_id_it_had_before_the_axis():
    from omegaconf import OmegaConf

    from harness.config import canonical_cell

    cfg = OmegaConf.create({"arch": {"name": "llama", "model": "fixture:llama"}, "method": {"name": "base"},
                            "kv": {"name": "native"}, "dispatch": {}, "bench": BenchConfig(), "rollback": "auto",
                            "reference": "base"})
    assert "context" not in canonical_cell(cfg)["bench"]
    cfg.bench.context = 1024
    assert canonical_cell(cfg)["bench"]["context"] == 1024
