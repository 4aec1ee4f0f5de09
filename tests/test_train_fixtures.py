"""The fixtures train through train/'s loop and objectives (train/fixtures.py): the drafters
train/ builds are the shapes that ship, the language-model objective is next-token
cross-entropy, and a short run writes files the harness's strict loaders read back."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

import train.fixtures as F
from engines.drafters.dflash import DFlashConfig, load_drafter
from engines.drafters.eagle3 import Eagle3Config, load_eagle3
from engines.drafters.mtp import MTPHead
from harness.models import fixtures
from train.lm import LanguageModelObjective


def _shapes(params: dict) -> dict:
    return {k: tuple(v.shape) for k, v in params.items()}


def _tiny_configs(monkeypatch) -> None:
    monkeypatch.setattr(F, "CONFIGS", {k: dataclasses.replace(c, steps=2, log_every=1, eval_every=2)
                                       for k, c in F.CONFIGS.items()})
    monkeypatch.setattr(F, "DISTILL_ROWS", 12)
    monkeypatch.setattr(F, "EVAL_ROWS", 4)


@pytest.mark.parametrize("name", fixtures.fixture_names())
def test_the_drafters_train_builds_are_the_shapes_that_ship(name, models):
    target, tok = models[name]
    rows, plens = [[5, 6, 7, 8, 9, 10, 11, 12]] * 2, [2, 2]
    cfg = F.CONFIGS["dflash"]
    d = F.DFlashObjective(target, tok, cfg, rows, plens,
                          shape=DFlashConfig.from_json(fixtures.DFLASH[name], "spec")).module
    assert _shapes(dict(tree_flatten(d.parameters()))) == \
        _shapes(mx.load(str(fixtures.SHIPPED_DIR / f"{name}.dflash.safetensors")))
    e = F.Eagle3Objective(target, tok, F.CONFIGS["eagle3"], rows, plens,
                          shape=Eagle3Config.from_json(fixtures.EAGLE3[name], "spec")).module
    shipped = mx.load(str(fixtures.SHIPPED_DIR / f"{name}.eagle3.safetensors"))
    assert e.config.draft_vocab_size == shipped["d2t"].shape[0] == fixtures.EAGLE3[name]["draft_vocab_size"]
    if "mtp" in F.kinds_for(name, list(F.KINDS)):
        head = F.MTPObjective(target, tok, F.CONFIGS["mtp"], rows, plens).module
        ship = {k[4:]: v for k, v in mx.load(str(fixtures.SHIPPED_DIR / f"{name}.safetensors")).items()
                if k.startswith("mtp.")}
        assert _shapes(dict(tree_flatten(head.parameters()))) == _shapes(ship)


def test_the_language_model_objective_is_next_token_cross_entropy(models):
    target, _ = models["llama"]
    rows = [list(range(3, 20)), list(range(40, 57))]
    obj = LanguageModelObjective(target)
    loss, metrics = obj.loss(target, obj.batch(rows, [0, 0], None))
    x = mx.array(rows)
    want = nn.losses.cross_entropy(target(x[:, :-1]).astype(mx.float32), x[:, 1:], reduction="mean")
    assert abs(loss.item() - want.item()) < 1e-4 and metrics["n"].item() == 2 * 16


def test_corpus_rows_are_seeded_and_some_end_in_a_copied_span():
    tok = Tokenizer.from_file(str(fixtures.SHIPPED_DIR / "tokenizer.json"))
    a, b = F.corpus_rows(tok, 40, 7), F.corpus_rows(tok, 40, 7)
    assert a == b and all(len(r) == F.SEQ + 1 for r in a)
    sep = tok.encode("\n").ids[0]
    copied = [r for r in a if any(r[i - k: i] == r[i + 1: i + 1 + k] and r[i] == sep
                                  for k in range(8, F.SEQ // 2) for i in range(k, len(r) - k))]
    assert 5 <= len(copied) < 40  # about half the rows repeat a span after a separator


def test_a_short_fixture_training_writes_what_the_strict_loaders_read(tmp_path, monkeypatch):
    _tiny_configs(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    tok = Tokenizer.from_file(str(fixtures.SHIPPED_DIR / "tokenizer.json"))
    model = F.train_target("llama", tok, tmp_path / "work", log=lambda _: None)
    F.save_target("llama", model, out)
    fresh = fixtures.build_model("llama")
    fresh.load_weights(list(mx.load(str(out / "llama.safetensors")).items()), strict=True)
    target, _ = mlx_lm.load(str(fixtures.fixture_dir("llama")))
    for kind, spec, loader in (("dflash", fixtures.DFLASH, load_drafter), ("eagle3", fixtures.EAGLE3, load_eagle3)):
        module = F.train_drafter(kind, "llama", tmp_path / "work", log=lambda _: None)
        F.save_drafter(kind, "llama", module, out)
        d = tmp_path / kind
        d.mkdir()
        (out / f"llama.{kind}.safetensors").rename(d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(spec["llama"]))
        loaded = loader(d, target)  # strict: every tensor present, every shape right
        assert set(dict(tree_flatten(loaded.parameters()))) == set(dict(tree_flatten(module.parameters())))


def test_the_mtp_head_is_saved_inside_the_target_checkpoint(tmp_path, monkeypatch):
    _tiny_configs(monkeypatch)
    src = fixtures.SHIPPED_DIR / "qwen35.safetensors"
    (tmp_path / "qwen35.safetensors").write_bytes(src.read_bytes())
    head = F.train_drafter("mtp", "qwen35", tmp_path / "work", log=lambda _: None)
    assert isinstance(head, MTPHead)
    F.save_drafter("mtp", "qwen35", head, tmp_path)
    saved = mx.load(str(tmp_path / "qwen35.safetensors"))
    before = mx.load(str(src))
    assert {k for k in saved if not k.startswith("mtp.")} == {k for k in before if not k.startswith("mtp.")}
    assert {k[4:] for k in saved if k.startswith("mtp.")} == set(dict(tree_flatten(head.parameters())))
    assert Path(tmp_path / "qwen35.safetensors").stat().st_size > 0


def test_dflash_labels_target_are_the_targets_choices_and_the_anchor_stays_the_rows_token(models):
    import random

    target, tok = models["llama"]
    row = [int(t) for t in mx.random.randint(3, 900, (40,), key=mx.random.key(3)).tolist()]
    shape = DFlashConfig.from_json(fixtures.DFLASH["llama"], "spec")
    cfg = dataclasses.replace(F.CONFIGS["dflash"], num_anchors=4, labels="target")
    obj = F.DFlashObjective(target, tok, cfg, [row], [1], shape=shape)
    b = obj.batch([row], [1], random.Random(0))
    choice = mx.argmax(target(mx.array([row])), axis=-1)[0].tolist()  # [T]: the target's pick for t + 1
    for i, a in enumerate(b["anchors"][0].tolist()):
        assert b["tokens"][0, i, 0].item() == row[a]
        for k in range(1, shape.block_size):
            if a + k < len(row):
                assert b["labels"][0, i, k].item() == choice[a + k - 1]
    data = F.DFlashObjective(target, tok, dataclasses.replace(cfg, labels="data"), [row], [1], shape=shape)
    bd = data.batch([row], [1], random.Random(0))
    assert bd["labels"][0, 0, 1].item() == row[bd["anchors"][0, 0].item() + 1]
