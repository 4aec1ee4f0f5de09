"""Drafter training (train/, `python -m train`): each objective lowers its loss on a
fixture target, the drafter it writes loads through the engine's strict loader and runs
losslessly, a stopped or killed run resumes, and training prompts never overlap evaluation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

from harness.errors import ConfigError
from tests.conftest import REPO, engine_cfg, subprocess_env

SMALL = ["data.n_prompts=10", "data.batch=5", "data.max_new_tokens=24", "data.eval_rows=2", "train.batch=4",
         "train.log_every=5", "train.eval_every=10", "train.lr=2e-3", "train.ttt_length=3",
         "train.draft_vocab_size=256", "train.num_anchors=4", "train.block_size=4", "train.intermediate_size=64"]
ENGINE = {"eagle3": "eagle3", "dflash": "dflash_a", "mtp": "mtp", "draft_model": "draft_model"}


def run(module: str, *args, timeout=900):
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env())


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("train-data")  # one self-distilled set per arch, shared by the tests


def _lossless_cell(arch: str, kind: str, drafter: Path, out: Path) -> dict:
    r = run("harness", f"arch={arch}", f"method={ENGINE[kind]}", f"method.drafter={drafter}", "bench=smoke",
            "bench.max_prompts=2", "bench.max_new_tokens=16", f"out_dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = [json.loads(p.read_text()) for p in out.glob("*.json")]
    return rec


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "mtp"])
def test_training_lowers_the_loss_and_the_drafter_runs_losslessly(arch, kind, tmp_path, data_cache):
    out = tmp_path / kind
    r = run("train", f"train={kind}", f"arch={arch}", f"out={out}", f"data.cache_dir={data_cache / arch}",
            "train.steps=30", *SMALL, "train.eval_head_tokens=8")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((out / "training.json").read_text())
    head = rec["final"]["eval"]
    assert len(head["acc_head"]) == len(head["acc"]) and head["head_tokens"] == 8
    assert "first 8 answer tokens [" in r.stderr
    losses = [h["loss"] for h in rec["history"] if h["split"] == "train"]
    assert losses[-1] < 0.8 * losses[0], losses
    assert rec["steps"] == 30 and rec["data"]["sha256"] and (out / "curves.png").stat().st_size > 1000
    assert "step 30/30" in r.stderr and "eta" in r.stderr  # progress with ETA
    cell = _lossless_cell(arch, kind, out, tmp_path / "cell")
    assert cell["status"] == "ok" and cell["summary"]["diverged_prompts"] == 0, cell.get("reason")


def test_a_draft_model_is_a_shallow_distilled_copy_that_loads_on_its_own(tmp_path, data_cache):
    import mlx_lm

    out = tmp_path / "dm"
    r = run("train", "train=draft_model", "arch=llama", f"out={out}", f"data.cache_dir={data_cache / 'llama'}",
            "train.steps=30", "train.num_layers=2", "train.share_embedding=false", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((out / "training.json").read_text())
    losses = [h["loss"] for h in rec["history"] if h["split"] == "train"]
    assert losses[-1] < 0.8 * losses[0], losses
    assert rec["drafter"] == {"layers_from_target": [0, 3], "num_layers": 2}
    model, tok = mlx_lm.load(str(out))  # a plain mlx-lm checkpoint with the target's tokenizer
    assert len(model.model.layers) == 2 and tok.encode("hello") == tok.encode("hello")
    cell = _lossless_cell("llama", "draft_model", out, tmp_path / "cell")
    assert cell["status"] == "ok" and cell["summary"]["diverged_prompts"] == 0, cell.get("reason")
    r = run("train", "train=draft_model", "arch=qwen35", f"out={tmp_path / 'q'}",
            f"data.cache_dir={data_cache / 'qwen35'}", "train.steps=2", *SMALL)
    assert r.returncode == 2 and "shallow copy of a dense target" in r.stderr, r.stderr[-2000:]


def test_eagle3_draft_vocabulary_is_the_most_frequent_answer_tokens_and_round_trips(tmp_path, data_cache):
    from engines.drafters.eagle3 import load_eagle3
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train.eagle3 import draft_vocab

    out = tmp_path / "e3"
    r = run("train", "train=eagle3", "arch=llama", f"out={out}", f"data.cache_dir={data_cache / 'llama'}",
            "train.steps=2", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    model, _ = load_target(resolve_model("fixture:llama"), "float32")
    drafter = load_eagle3(out, model)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # distinct on a 4-layer target
    rows = [json.loads(line) for f in sorted((data_cache / "llama").glob("shard-*.jsonl"))
            for line in f.read_text().splitlines()]
    answers = [t for row in rows for t in row["answer_ids"]]
    top = max(set(answers), key=answers.count)
    mapped = drafter.to_target(mx.arange(cfg["draft_vocab_size"])).tolist()
    assert top in mapped and mapped == sorted(mapped)
    assert draft_vocab([[5, 1, 1, 2]], [1], vocab=10, size=3).tolist() == [0, 1, 2]  # 1 and 2 seen; 0 fills


def test_a_stopped_run_resumes_to_bitwise_the_same_weights(tmp_path, data_cache):
    common = ["train=dflash", "arch=llama", f"data.cache_dir={data_cache / 'llama'}", "train.steps=16",
              "train.ckpt_every_steps=4", "train.export=last", *SMALL]  # DFlash: the anchors are random draws, replayed by step
    assert run("train", *common, f"out={tmp_path / 'a'}").returncode == 0
    first = run("train", *common, f"out={tmp_path / 'b'}", "train.stop_after=8")
    assert first.returncode == 0 and "stopped at step 8/16" in first.stderr, first.stderr[-2000:]
    assert json.loads((tmp_path / "b" / "training.json").read_text())["complete"] is False  # the step-8 drafter
    second = run("train", *common, f"out={tmp_path / 'b'}")
    assert second.returncode == 0 and "resumed from" in second.stderr and "(step 8," in second.stderr
    a, b = mx.load(str(tmp_path / "a" / "model.safetensors")), mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)
    rec = json.loads((tmp_path / "b" / "training.json").read_text())
    assert rec["resumed_from"] == [8] and rec["complete"] is True


def test_the_exported_drafter_is_the_step_of_the_lowest_held_out_loss(tmp_path, data_cache):
    common = ["train=eagle3", "arch=llama", f"data.cache_dir={data_cache / 'llama'}", *SMALL, "train.eval_every=2",
              "train.lr=1.0", "train.steps=100"]  # a rate so high the held-out loss climbs after its first falls
    r = run("train", *common, "train.stop_after=12", f"out={tmp_path / 'best'}")
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "best" / "training.json").read_text())
    evals = [h for h in rec["history"] if h["split"] == "eval"]
    best = min(evals, key=lambda h: h["loss"])
    assert best["step"] < 12, [h["loss"] for h in evals]  # otherwise best and last coincide and nothing is tested
    assert rec["exported_step"] == best["step"] and rec["exported_eval"]["loss"] == round(best["loss"], 5)
    # the same run stopped at that step and exported as it stands holds the same weights
    r = run("train", *common, f"train.stop_after={best['step']}", "train.export=last", f"out={tmp_path / 'last'}")
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = (mx.load(str(tmp_path / d / "model.safetensors")) for d in ("best", "last"))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


def test_a_killed_run_resumes_from_its_last_checkpoint(tmp_path, data_cache):
    out = tmp_path / "k"
    args = ["train=mtp", "arch=llama", f"out={out}", f"data.cache_dir={data_cache / 'llama'}", "train.steps=2000",
            "train.ckpt_every_steps=3", *SMALL]
    proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=subprocess_env())
    deadline = time.time() + 300
    while time.time() < deadline and not list((out / "ckpt").glob("step-0000006")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # no handler runs: only checkpoints already renamed survive
    proc.wait()
    done = sorted(int(p.name.split("-")[1]) for p in (out / "ckpt").glob("step-*"))
    assert done and done[-1] >= 6
    again = run("train", *args, f"train.stop_after={done[-1] + 3}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"(step {done[-1]}," in again.stderr and f"stopped at step {done[-1] + 3}/2000" in again.stderr


def test_every_evaluation_prompt_is_refused_as_a_training_prompt(tmp_path):
    from train.data import check_overlap, eval_texts

    texts, sources = eval_texts()
    assert set(texts) == {"builtin", "mtbench", "humaneval", "gsm8k"}, sources  # the data packages are installed
    for suite, turns in texts.items():
        for t in turns[:5]:
            with pytest.raises(ConfigError, match=f"overlaps the {suite}"):
                check_overlap([t], texts)
            if len(t.split()) > 30:  # a shared 13-word run inside other text is refused too
                with pytest.raises(ConfigError, match="overlaps"):
                    check_overlap(["Please answer: " + " ".join(t.split()[3:20]) + " thanks"], texts)
    check_overlap(["Write a limerick about a cat who learns to sail."], texts)
    prompts = tmp_path / "p.jsonl"
    for suite in ("mtbench", "gsm8k"):  # a question pasted into the training prompts
        prompts.write_text(json.dumps({"prompt": "Tell me a story."}) + "\n" + json.dumps({"turns": [texts[suite][0]]}))
        r = run("train", "train=mtp", "arch=llama", f"out={tmp_path / suite}", f"data.prompts={prompts}",
                "data.n_prompts=2", "data.eval_rows=1")
        assert r.returncode == 2 and f"overlaps the {suite} evaluation suite" in r.stderr, r.stderr[-2000:]
        assert not (tmp_path / suite / "data").exists()  # refused before any answer, and no cache left behind
    prompts.write_text(json.dumps({"prompt": "Tell me a story."}) + "\n" + json.dumps({"prompt": "Name three rivers."}))
    r = run("train", "train=mtp", "arch=llama", f"out={tmp_path / 'gsm8k'}", f"data.prompts={prompts}",
            "data.n_prompts=2", "data.eval_rows=1", "data.stop_after=prompts")
    assert r.returncode == 0, r.stderr[-2000:]  # the corrected rerun is not blocked by the refused run's cache


def test_magpie_prefix_is_the_template_text_before_the_user_message():
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train.data import user_prefix

    _, tok = load_target(resolve_model("fixture:llama"), "float32")
    assert user_prefix(tok) == "<|user|>\n"


def test_magpie_resumes_from_its_last_round_to_the_same_instructions(tmp_path):
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train.config import DataConfig
    from train.data import magpie_prompts

    model, tok = load_target(resolve_model("fixture:llama"), "float32")
    cfg = DataConfig(batch=2, magpie_max_tokens=24)
    whole = magpie_prompts(model, tok, 6, cfg, lambda m: None, tmp_path / "a.json")

    def killed_after_round_one(msg):
        if "(round 1," in msg:
            raise KeyboardInterrupt  # after the round's result was saved, as a kill would land
    with pytest.raises(KeyboardInterrupt):
        magpie_prompts(model, tok, 6, cfg, killed_after_round_one, tmp_path / "b.json")
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["rounds"] == 1 and 0 < len(saved["prompts"]) < 6
    logs = []
    assert magpie_prompts(model, tok, 6, cfg, logs.append, tmp_path / "b.json") == whole and len(whole) == 6
    assert logs[0].startswith("magpie: resumed at")


def test_magpie_stops_when_rounds_add_nothing(tmp_path):
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train.config import DataConfig
    from train.data import magpie_prompts

    model, tok = load_target(resolve_model("fixture:llama"), "float32")
    greedy = DataConfig(batch=2, magpie_max_tokens=12, magpie_temperature=0.0)  # every candidate the same text
    with pytest.raises(ConfigError, match=r"in [34] rounds, fewer than data.n_prompts=6"):
        magpie_prompts(model, tok, 6, greedy, lambda m: None)


def test_bad_training_settings_are_one_line_errors(tmp_path):
    r = run("train", "train=eagle3", "arch=llama", f"out={tmp_path}", "train.steps=0")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: train.steps=0 must be > 0 and <=")
    r = run("train", "train=mtp", "arch=llama", f"out={tmp_path}", "train.eval_head_tokens=1")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: train.eval_head_tokens=1 must be >= 2")
    r = run("train", "train=medusa", "arch=llama", f"out={tmp_path}")
    assert r.returncode == 2 and "medusa" in r.stderr and "Traceback" not in r.stderr
    r = run("train", "train=mtp", "arch=llama", f"out={tmp_path}", f"data.prompts={tmp_path / 'none.txt'}")
    assert r.returncode == 2 and "is not a file" in r.stderr


def test_ttt_unroll_equals_the_drafters_chained_inference():
    """Step k of the training unroll at position i computes what the drafter computes at
    inference when it chains k steps past position i (step 0's keys causal, then only its own)."""
    from engines.drafters.eagle3 import Eagle3Config, Eagle3Drafter
    from train.eagle3 import ttt_step
    from train.objective import shift

    c = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                     rms_norm_eps=1e-6, max_position_embeddings=128, vocab_size=50, draft_vocab_size=50,
                     target_hidden_size=32, head_dim=8, norm_before_residual=True, qk_norm=False,
                     layer_types=("full_attention",), aux_layer_ids=(1, 2, 3))
    mx.random.seed(3)
    d = Eagle3Drafter(c, own_embedding=True)
    d.set_dtype(mx.float32)
    T, i = 12, 5
    ids = mx.random.randint(0, 50, (1, T))
    feats = mx.random.normal((1, T, 96))
    keys, values, outs, h = [], [], [], d.fuse(feats)
    for k in range(4):
        h = ttt_step(d, d.embed_tokens(shift(ids, k + 1)), h, keys, values, k)
        outs.append(h)
        h = d.next_feature(h)
    caches = d.make_cache()
    h = d.step(d.embed_tokens(ids[:, 1:i + 2]), d.fuse(feats[:, :i + 1]), caches, 0)  # positions 0..i
    assert mx.allclose(h[:, i], outs[0][:, i], atol=1e-5)
    h = h[:, i:i + 1]
    for k in range(1, 4):  # chain: the drafter's own output and the next token, one position on
        h = d.step(d.embed_tokens(ids[:, i + k + 1:i + k + 2]), d.next_feature(h), caches, i + k)
        assert mx.allclose(h[:, 0], outs[k][:, i], atol=1e-5), k


def test_many_anchor_block_attention_equals_the_engines_one_anchor_path():
    from engines.drafters.dflash import DFlashConfig, DFlashDrafter
    from train.dflash import block_attention

    c = DFlashConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=48, rms_norm_eps=1e-6, max_position_embeddings=128, block_size=4,
                     target_layer_ids=(1,), mask_token_id=0, layer_types=("full_attention",))
    mx.random.seed(4)
    d = DFlashDrafter(c)
    attn, L = d.layers[0].self_attn, 4
    ctx = mx.random.normal((1, 14, 32))
    anchors = mx.array([[3, 9]])
    x = mx.random.normal((1, 2 * L, 32))
    many = block_attention(attn, x, ctx, d._rope, anchors)  # [1, 2L, H]
    one = attn(x.reshape(2, L, 32), mx.concatenate([ctx, ctx]), d._rope, anchors=anchors[0])  # [2, L, H]
    assert mx.allclose(many.reshape(2, L, 32), one, atol=1e-5)


def test_quantized_drafters_load_strictly_and_stay_lossless(tmp_path, data_cache):
    from engines.drafters.dflash import load_drafter
    from engines.errors import DrafterError
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model
    from train.quantize import quantize_drafter

    src = tmp_path / "d"
    assert run("train", "train=dflash", "arch=llama", f"out={src}", f"data.cache_dir={data_cache / 'llama'}",
               "train.steps=2", *SMALL).returncode == 0
    counts = quantize_drafter(src, tmp_path / "q", bits=8, group_size=32)
    assert counts["packed"] >= 6
    assert (tmp_path / "q" / "model.safetensors").stat().st_size < 0.6 * (src / "model.safetensors").stat().st_size
    cell = _lossless_cell("llama", "dflash", tmp_path / "q", tmp_path / "cell")
    assert cell["status"] == "ok" and cell["summary"]["diverged_prompts"] == 0
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    del cfg["quantization"]
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    model, _ = load_target(resolve_model("fixture:llama"), "float32")
    with pytest.raises(DrafterError, match="no quantization"):
        load_drafter(tmp_path / "q", model)


def test_zlab_reference_runs_a_trained_dflash_drafter_with_the_same_tokens_and_drafts(models, tmp_path, data_cache):
    """z-lab's MLX DFlash loads what the trainer writes and drafts as this harness's engine does:
    the same output tokens and the same accepted count in every round (float32)."""
    pytest.importorskip("dflash.model_mlx", reason="z-lab's dflash is an optional extra: pip install -e '.[anchors]'")
    from types import SimpleNamespace

    from engines.arms.external import DFlashZlab
    from engines.methods.dflash import DFlashA
    from engines.runtime.target import Target
    from tests.helpers import generate_ids
    from tests.test_lossless import _units

    out = tmp_path / "d"
    more = ["data.n_prompts=60", "data.batch=30", "data.max_new_tokens=48", "train.num_anchors=16"]  # a drafter that drafts
    assert run("train", "train=dflash", "arch=llama", f"out={out}", f"data.cache_dir={data_cache / 'zlab'}",
               "train.steps=150", "train.export=last", *SMALL, *more).returncode == 0
    model, tok = models["llama"]
    cfg = engine_cfg(block_size=None, drafter=str(out), verify="batched")
    ours, ref = DFlashA.build(model, cfg), DFlashZlab(Target(model), cfg)
    ref.tokenizer = tok
    accepted = 0
    for uid, ids in list(_units(tok))[:6]:
        a, b = generate_ids(ours, ids, 24), generate_ids(ref, ids, 24)
        assert a.tokens == b.tokens, uid
        # z-lab drafts fewer tokens when fewer than a block remain: compare the rounds with full blocks
        # and not the last round, whose accepted count each loop cuts at the token budget its own way
        full = [(x.accepted, y.accepted) for x, y in zip(a.rounds[:-1], b.rounds[:-1]) if x.drafted == y.drafted]
        assert len(full) >= len(b.rounds) - 3 and all(x == y for x, y in full), (uid, full)
        accepted += sum(x for x, _ in full)
    assert accepted > 0, "no draft accepted: the comparison would prove little"


def test_dflash_blocks_see_answer_anchors_with_data_token_labels(models):
    """Anchors sit on answer tokens with context before them; block position k is labelled with
    x_{a+k}, weight 0 at the anchor itself and for the weightless repeats filling a short row."""
    import random
    from types import SimpleNamespace

    from train.dflash import DFlashObjective

    cfg = SimpleNamespace(labels="data", target_layer_ids=None, num_target_features=2, mask_token_id=None, num_layers=1,
                          intermediate_size=32, block_size=4, seed=0, num_anchors=4, loss_decay_gamma=7.0)
    model, tok = models["llama"]
    obj = DFlashObjective(model, tok, cfg, [], [])
    row = list(range(20, 30))  # 10 tokens, the last 3 the answer: anchors 7 and 8 only
    b = obj.batch([row], [7], random.Random(0))
    assert b["anchors"].tolist()[0][:2] == [7, 8]
    assert b["labels"][0, 0].tolist() == [27, 28, 29, 29]  # x_{a+k}, clipped past the end
    counted = b["counted"][0]
    assert counted[:, 0].tolist() == [1, 1, 0, 0]  # the anchor token is given, never scored...
    assert counted[0, 1:].tolist() == [1, 1, 0] and counted[1, 1:].tolist() == [1, 0, 0]  # ...nor past the row
    assert counted[2:].sum().item() == 0 and b["weight"][..., 0].sum().item() == 0
    assert (b["tokens"][0, :, 1:] == obj.module.config.mask_token_id).all().item()


@pytest.mark.parametrize("args, said", [
    (["train=dflash", "train.mask_token_id=99999"], "train.mask_token_id=99999 is outside the target's vocabulary"),
    (["train=dflash", "train.target_layer_ids=[0,99]"], "[99] not among the target's layers"),
    (["train=eagle3", "train.aux_layer_ids=[-1,1,2]"], "[-1] not among the target's layers"),
])
def test_impossible_ids_for_training_are_one_line_not_a_crash(args, said, tmp_path, data_cache):
    r = run("train", *args, "arch=llama", f"out={tmp_path / 'o'}", f"data.cache_dir={data_cache / 'llama'}",
            "train.steps=2", *SMALL)
    assert r.returncode == 2, r.stderr[-2000:]  # was a segfault (exit 139) for the mask id
    assert said in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("where", ["a_file", "a_file/under_it"])
def test_training_into_an_out_that_cannot_hold_it_is_one_line(tmp_path, where):
    (tmp_path / "a_file").write_text("not a folder")
    r = run("train", "train=mtp", "arch=llama", f"out={tmp_path / where}", "train.steps=2", *SMALL)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: out=") and "pass a writable directory, e.g. out=drafters/mine" in lines[-1]
    assert "Traceback" not in r.stderr


def test_two_trainings_into_one_out_are_refused_while_the_first_holds_it(tmp_path):
    from train.__main__ import hold_out_lock

    held = hold_out_lock(tmp_path / "o")
    with pytest.raises(ConfigError, match=f"being written by another training \\(pid {os.getpid()}\\)"):
        hold_out_lock(tmp_path / "o")
    held.close()
    hold_out_lock(tmp_path / "o").close()  # free once the first has ended


def test_resuming_into_a_checkpoint_of_another_drafter_shape_is_one_line(tmp_path, data_cache):
    common = ["train=eagle3", "arch=llama", f"data.cache_dir={data_cache / 'llama'}", f"out={tmp_path / 'o'}",
              "train.ckpt_every_steps=2", *SMALL]
    assert run("train", *common, "train.steps=2").returncode == 0
    r = run("train", *[c for c in common if "intermediate_size" not in c], "train.intermediate_size=96",
            "train.steps=4")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "checkpoint of another drafter shape" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "mtp", "draft_model"])
def test_a_warm_start_takes_an_exports_weights_and_refuses_another_shape(kind, models, tmp_path):
    from dataclasses import replace

    from mlx.utils import tree_flatten, tree_map

    from train.__main__ import objective_for
    from train.config import TrainConfig
    from train.quantize import quantize_drafter

    target, tok = models["llama"] if kind != "mtp" else models["qwen35"]
    rows = [[(7 * i + 3 * j) % 200 + 5 for j in range(24)] for i in range(6)]
    cfg = TrainConfig(kind=kind, draft_vocab_size=64, intermediate_size=64, block_size=4, num_layers=1, ttt_length=2)
    make = lambda c=cfg, r=rows: objective_for(kind)(target, tok, c, r, [4] * len(r))
    trained = make()
    trained.module.update(tree_map(lambda w: w + 0.01 if mx.issubdtype(w.dtype, mx.floating) else w,
                                   trained.module.trainable_parameters()))
    trained.export(trained.module, tmp_path / "f", mx.float32)
    fresh = make()
    rec = fresh.warm_start(tmp_path / "f")
    assert rec["quantized"] is False and len(rec["weights_sha256"]) == 64
    for (k, a), (_, b) in zip(tree_flatten(fresh.module.parameters()), tree_flatten(trained.module.parameters())):
        assert mx.array_equal(a, b).item(), k  # float32 out, float32 back: the same weights
    quantize_drafter(tmp_path / "f", tmp_path / "q", bits=8, group_size=32)
    assert make().warm_start(tmp_path / "q")["quantized"] is True  # dequantized, then read strictly
    if kind != "mtp":  # an MTP head's shape is the target's alone
        with pytest.raises(ConfigError, match="has shape|is missing from it"):
            make(replace(cfg, intermediate_size=96, num_layers=2)).warm_start(tmp_path / "f")
    if kind == "eagle3":  # over other rows (another draft vocabulary), a warm start keeps its drafter's
        other = make(r=[[(11 * i + 5 * j) % 300 + 100 for j in range(24)] for i in range(6)])
        assert not mx.array_equal(other.used, trained.used).item()
        other.warm_start(tmp_path / "f")
        assert mx.array_equal(other.used, trained.used).item() and mx.array_equal(other.module.d2t, trained.module.d2t)
        assert mx.array_equal(other.in_draft, trained.in_draft).item()


def test_a_training_run_warm_started_says_so_in_its_record(tmp_path, data_cache):
    common = ["train=dflash", "arch=llama", f"data.cache_dir={data_cache / 'llama'}", *SMALL]
    assert run("train", *common, f"out={tmp_path / 'a'}", "train.steps=2").returncode == 0
    r = run("train", *common, f"out={tmp_path / 'b'}", "train.steps=2", f"train.init={tmp_path / 'a'}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"starting from {tmp_path / 'a'}" in r.stderr
    rec = json.loads((tmp_path / "b" / "training.json").read_text())
    first = json.loads((tmp_path / "a" / "training.json").read_text())
    assert rec["init"]["weights_sha256"] == first["weights_sha256"] and rec["init"]["quantized"] is False
    r = run("train", *common, f"out={tmp_path / 'c'}", "train.steps=2", f"train.init={tmp_path / 'none'}")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: train.init="), r.stderr[-800:]


class _Recorder:
    """An objective that scores every row's answer length, so the rows it was given show."""
    kind, module = "stub", None

    def __init__(self):
        self.seen = []

    def batch(self, rows, plens, rng):
        self.seen.append([len(r) - p for r, p in zip(rows, plens)])
        return rows, plens

    def loss(self, module, b):
        rows, plens = b
        answer = sum(len(r) - p for r, p in zip(rows, plens)) / len(rows)
        return mx.array(1.0), {"acc": mx.array([answer]), "n": mx.array(float(len(rows)))}


def test_held_out_accuracy_is_also_taken_over_the_answers_first_tokens():
    from train.config import TrainConfig
    from train.loop import State, _log_eval, answer_heads

    assert answer_heads([[1, 2, 3, 4, 5, 6], [7, 8, 9]], [2, 1], 2) == [[1, 2, 3, 4], [7, 8, 9]]
    rows, plens = [list(range(40)), list(range(12))], [10, 4]  # answers of 30 and 8 tokens
    for n, want in ((None, None), (16, [(16 + 8) / 2]), (64, [(30 + 8) / 2])):
        obj, state, lines = _Recorder(), State(), []
        _log_eval(state, obj, (rows, plens), TrainConfig(kind="mtp", batch=4, eval_head_tokens=n), lines.append)
        (entry,) = state.history
        assert entry["acc"] == [19.0] and entry.get("acc_head") == want and entry.get("head_tokens") == n
        assert obj.seen == ([[30, 8]] if n is None else [[30, 8], [min(30, n), 8]])
        assert ("first" in lines[0]) == (n is not None)

