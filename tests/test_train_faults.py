"""`python -m train` under hostile input and a failing machine (issue 50): every number refused
before anything runs (one line naming the setting and the bound, exit 2, nothing written), the
target's ids checked before the data step, text that is not UTF-8 named with its setting, a
corrupt train.init one line, a damaged checkpoint passed over for an older one, and a refused
write one line naming the file, the setting and the cure (exit 3), never "rerun to resume"."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from harness.errors import ConfigError
from tests.conftest import REPO, subprocess_env

# Each value a tester tried on every numeric setting: not finite, beyond any bound, below any, of the wrong type.
HOSTILE = ["nan", "inf", "-inf", "1e400", "100000000000000000000000000000", "-1", "abc", "true", "[1]"]
SMALL = ["data.n_prompts=10", "data.batch=5", "data.max_new_tokens=24", "data.eval_rows=2", "train.batch=4",
         "train.intermediate_size=64", "train.steps=2"]


def train(*args, env=None, prefix="", timeout=300):
    """`python -m train` in a child (through bash when `prefix` sets a limit first)."""
    cmd = [sys.executable, "-m", "train", *args]
    if prefix:
        cmd = ["bash", "-c", f'{prefix}; exec "$@"', "bash", *cmd]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=env or subprocess_env())


def last_line(r) -> str:
    return r.stderr.strip().splitlines()[-1]


def numeric_settings() -> list[str]:
    """Every int or float setting of train.* and data.* (Optional ones included), from the schema."""
    from train.config import DataConfig, TrainConfig

    out = []
    for section, cls in (("train", TrainConfig), ("data", DataConfig)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
            if kinds & {int, float}:
                out.append(f"{section}.{f.name}")
    return out


# ---------------------------------------------------------------- numbers, before anything runs

def test_every_numeric_setting_has_a_bound():
    from train.config import DATA_BOUNDS, TRAIN_BOUNDS

    bounded = {f"train.{k}" for k in TRAIN_BOUNDS} | {f"data.{k}" for k in DATA_BOUNDS}
    assert set(numeric_settings()) == bounded  # a new number in the schema needs its range


@pytest.fixture(scope="module")
def composed():
    """The training config as `python -m train train=eagle3 arch=llama` composes it (Hydra's node dropped)."""
    from omegaconf import open_dict

    from harness.flags import compose_first_job
    from train.config import register

    register()
    base = compose_first_job("training", ["train=eagle3", "arch=llama", "out=/nonexistent/never-made"])
    with open_dict(base):
        base.pop("hydra")
    return base


def test_hostile_values_of_every_numeric_setting_are_one_line_naming_it(composed):
    """Each value as the command line gives it (Hydra's override parser, then the schema's types, then
    validate): refused by one or the other, never passed, never another exception."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from train.config import validate

    parser = OverridesParser.create()
    for key in numeric_settings():
        for raw in HOSTILE:
            override = parser.parse_override(f"{key}={raw}")
            cfg = composed.copy()
            try:
                OmegaConf.update(cfg, key, override.value(), merge=True)
                validate(OmegaConf.to_object(cfg))
            except ValidationError as e:  # the schema's type: compose_first_job's one line names e.full_key
                assert e.full_key == key, (key, raw, e)
                continue
            except ConfigError as e:
                line = str(e)
                assert line.startswith(f"{key}=") and "\n" not in line, (key, raw, line)
                assert "must be" in line or "not among" in line, line  # the bound is named
                continue
            pytest.fail(f"{key}={raw} passed validation")


def test_validate_refuses_what_the_types_let_through_when_called_directly():
    """Objects built in code (train/fixtures.py, tests) skip Hydra's types: validate checks them itself."""
    from train.config import DataConfig, TrainAppConfig, TrainConfig, validate

    base = TrainAppConfig(arch=None, train=TrainConfig(kind="eagle3"), data=DataConfig(), out="x")
    validate(base)
    for key in numeric_settings():
        section, name = key.split(".")
        for value in (math.nan, math.inf, -math.inf, 10**30, -1, "7", True, [1], 1e300):
            node = dataclasses.replace(getattr(base, section), **{name: value})
            with pytest.raises(ConfigError, match=f"^{key}="):
                validate(dataclasses.replace(base, **{section: node}))


@pytest.mark.parametrize("args, said", [
    (["train.aux_layer_ids=[1,1,2]"], "train.aux_layer_ids=[1, 1, 2] names a layer twice"),
    (["data.max_prompt_tokens=600"], "data.max_prompt_tokens=600 leaves no two answer tokens within data.max_len=512"),
    (["data.eval_rows=10", "data.n_prompts=10"], "data.eval_rows=10 must be in [0, data.n_prompts=10)"),
])
def test_settings_that_must_agree_are_refused_together(composed, args, said):
    from omegaconf import OmegaConf

    from train.config import validate

    cfg = composed.copy()
    for a in args:
        key, value = a.split("=", 1)
        OmegaConf.update(cfg, key, json.loads(value), merge=True)
    with pytest.raises(ConfigError) as e:
        validate(OmegaConf.to_object(cfg))
    assert str(e.value).startswith(said)


def test_a_nan_learning_rate_is_refused_before_hydra_makes_out(tmp_path):
    """Was: trained (a NaN loss) after answering every prompt, leaving out/ and a data cache."""
    out = tmp_path / "deep" / "out"
    r = train("train=eagle3", "arch=llama", f"out={out}", "train.lr=nan", timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == "error: train.lr=nan must be > 0 and <= 10 (a finite number)"
    assert not (tmp_path / "deep").exists()  # nothing written: no out, no data cache


# ---------------------------------------------------------------- the environment and text inputs

def test_a_harness_home_that_cannot_be_made_is_one_line_naming_the_variable(tmp_path):
    """Was: a traceback (NotADirectoryError) once the fixture target was resolved, exit 3."""
    (tmp_path / "file").write_text("not a folder")
    env = subprocess_env(SPEC_HARNESS_HOME=str(tmp_path / "file" / "home"))
    r = train("train=mtp", "arch=llama", f"out={tmp_path / 'o'}", env=env, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    line = last_line(r)
    assert line.startswith(f"error: SPEC_HARNESS_HOME={tmp_path / 'file' / 'home'} cannot be used: ")
    assert line.endswith("set SPEC_HARNESS_HOME to a writable directory") and not (tmp_path / "o").exists()


def test_a_prompts_file_that_is_not_utf8_names_the_file_and_the_setting(tmp_path):
    """Was: UnicodeDecodeError naming neither, exit 3, after the target loaded."""
    bad = tmp_path / "prompts.txt"
    bad.write_bytes("Write a poem about the sea.\nCaf\u00e9 au lait\n".encode("latin-1"))
    r = train("train=mtp", "arch=llama", f"out={tmp_path / 'o'}", f"data.prompts={bad}", timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == (f"error: data.prompts={bad} is not UTF-8 text (byte 31: invalid continuation byte); "
                                "pass a UTF-8 .jsonl or .txt of prompts, or null for Magpie")
    assert not (tmp_path / "o").exists()


def test_prompt_files_of_any_shape_are_one_line(tmp_path):
    from train.data import read_prompt_file

    cases = {'{"turns": {"a": 1}}': "no prompt", '[1, 2]': "no prompt", '{"prompt": 3}': "no prompt",
             '{"prompt": "x"': "not JSON"}  # the first was a KeyError traceback
    path = tmp_path / "prompts.jsonl"
    for text, said in cases.items():
        path.write_text(text + "\n")
        with pytest.raises(ConfigError, match=f"^data.prompts={path}:1: {said}"):
            read_prompt_file(path)


def test_a_damaged_data_cache_file_is_one_line_naming_it(tmp_path):
    from train.data import _shard_rows, read_manifest

    (tmp_path / "manifest.json").write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match=r"data cache file .*manifest.json is damaged .*delete it"):
        read_manifest(tmp_path)
    shard = tmp_path / "shard-00000.jsonl"
    shard.write_text('{"prompt_ids": [1, 2], "answer_ids": [3, 4]}\n{"prompt_ids": [1, 2], "answ')
    with pytest.raises(ConfigError, match=r"shard-00000.jsonl is damaged"):
        _shard_rows(shard)
    shard.write_text('{"prompt_ids": [1, 2], "answer_ids": "34"}\n')
    with pytest.raises(ConfigError, match=r"a row without prompt_ids and answer_ids"):
        _shard_rows(shard)


# ---------------------------------------------------------------- the target's ids, before the data step

@pytest.fixture(scope="module")
def llama():
    from harness.models.load import load_target
    from harness.models.resolve import resolve_model

    target, tok = load_target(resolve_model("fixture:llama"), "float32")  # 4 layers, a 1,024-token vocabulary
    target.eval()
    target.freeze()
    return target, tok


@pytest.mark.parametrize("kind, setting, said", [
    ("eagle3", {"aux_layer_ids": [0, 1, 2]}, "train.aux_layer_ids=[0, 1, 2]: [0] not among the target's layers 1..4"),
    ("eagle3", {"aux_layer_ids": [2, 3, 5]}, "[5] not among the target's layers 1..4"),
    ("dflash", {"target_layer_ids": [1, 4]}, "train.target_layer_ids=[1, 4]: [4] not among the target's layers 0..3"),
    ("dflash", {"mask_token_id": 1024}, "train.mask_token_id=1024 is outside the target's vocabulary [0, 1024)"),
    ("draft_model", {"num_layers": 5}, "train.num_layers=5 is more than the target's 4 layers"),
])
def test_ids_and_sizes_that_do_not_fit_the_target_are_refused_by_check(llama, kind, setting, said):
    """objective.check runs right after the target loads and before data (was: in the objective's
    constructor, after the data step; aux id 0 was even trained and refused only by the export's loader)."""
    from train.__main__ import objective_for
    from train.config import TrainConfig

    with pytest.raises(ConfigError) as e:
        objective_for(kind).check(llama[0], TrainConfig(kind=kind, **setting))
    assert said in str(e.value)
    objective_for(kind).check(llama[0], TrainConfig(kind=kind))  # the defaults fit


def test_a_mask_id_past_the_vocabulary_leaves_no_out_and_no_data_cache(tmp_path):
    """Was: the data step answered every prompt (a cache under out/data), then the objective refused."""
    r = train("train=dflash", "arch=llama", f"out={tmp_path / 'o'}", "train.mask_token_id=99999", *SMALL)
    assert r.returncode == 2, r.stderr[-2000:]
    assert last_line(r).startswith("error: train.mask_token_id=99999 is outside the target's vocabulary")
    assert "data:" not in r.stderr and "magpie" not in r.stderr  # no data step ran
    assert not (tmp_path / "o").exists()  # Hydra's out folder, made for the job, is gone again


# ---------------------------------------------------------------- train.init and checkpoints

@pytest.fixture(scope="module")
def exported(llama, tmp_path_factory):
    """An EAGLE-3 drafter exported for the llama fixture, and a maker of objectives of its shape."""
    import mlx.core as mx

    from train.__main__ import objective_for
    from train.config import TrainConfig

    cfg = TrainConfig(kind="eagle3", draft_vocab_size=64, intermediate_size=64, ttt_length=2)
    make = lambda: objective_for("eagle3")(*llama, cfg, [], [])
    folder = tmp_path_factory.mktemp("init") / "drafter"
    make().export(make().module, folder, mx.float32)
    return folder, make


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_corrupt_init_is_one_line_naming_train_init(exported, tmp_path):
    """Was: a traceback from the loader (not safetensors, cut short) after the data step."""
    import mlx.core as mx

    folder, make = exported
    make().warm_start(folder)  # the whole one is taken
    junk = _copy(folder, tmp_path / "junk")
    (junk / "model.safetensors").write_bytes(b"not safetensors at all")
    cut = _copy(folder, tmp_path / "cut")
    whole = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    short = _copy(folder, tmp_path / "short")
    tensors = mx.load(str(short / "model.safetensors"))
    tensors.pop(sorted(k for k in tensors if k.startswith("layers."))[0])
    mx.save_safetensors(str(short / "model.safetensors"), tensors)
    notjson = _copy(folder, tmp_path / "notjson")
    (notjson / "config.json").write_bytes(b"\xff{")
    for bad in (junk, cut, short, notjson):
        with pytest.raises(ConfigError) as e:
            make().warm_start(bad)
        line = str(e.value)
        assert line.startswith(f"train.init={bad}: ") and "\n" not in line, line
        assert "leave train.init null" in line


def test_a_corrupt_init_is_refused_before_the_data_step(exported, llama, tmp_path):
    from train.__main__ import check_before_data, objective_for
    from train.config import TrainConfig

    folder, _ = exported
    junk = _copy(folder, tmp_path / "junk")
    (junk / "model.safetensors").write_bytes(b"\0" * 64)
    cfg = TrainConfig(kind="eagle3", draft_vocab_size=64, intermediate_size=64, ttt_length=2)
    check_before_data(objective_for("eagle3"), *llama, dataclasses.replace(cfg, init=str(folder)))  # fits
    with pytest.raises(ConfigError, match=f"^train.init={junk}: not a readable eagle3 drafter"):
        check_before_data(objective_for("eagle3"), *llama, dataclasses.replace(cfg, init=str(junk)))


def _tiny():
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    mx.random.seed(0)
    module = nn.Linear(4, 4)
    opt = optim.AdamW(learning_rate=1e-3)
    opt.init(module.trainable_parameters())
    return module, opt


def _checkpoints(ckdir: Path, *steps: int) -> None:
    from train.loop import State, save

    module, opt = _tiny()
    for s in steps:
        save(ckdir, module, opt, State(step=s, elapsed_s=float(s)))


def test_a_damaged_newest_checkpoint_is_named_and_the_older_one_used(tmp_path):
    """Was: a traceback from mx.load (the newest cut short), exit 3, and every rerun the same."""
    from train.loop import restore

    ckdir = tmp_path / "ckpt"
    _checkpoints(ckdir, 2, 4)
    weights = ckdir / "step-0000004" / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])  # cut short
    lines = []
    state = restore(ckdir, *_tiny(), lines.append)
    assert state.step == 2 and state.resumed_from == [2]
    assert lines[0].startswith(f"warning: checkpoint {ckdir / 'step-0000004'} is damaged (weights.safetensors: ")
    assert lines[0].endswith("moved to damaged-step-0000004, trying an older one") and len(lines) == 2
    assert sorted(p.name for p in ckdir.iterdir()) == ["damaged-step-0000004", "step-0000002"]


def test_with_no_good_checkpoint_training_starts_afresh_and_says_so(tmp_path):
    from train.loop import restore

    ckdir = tmp_path / "ckpt"
    _checkpoints(ckdir, 2, 4)
    (ckdir / "step-0000004" / "state.json").write_text('{"step": 4, "elap')
    (ckdir / "step-0000002" / "optimizer.safetensors").unlink()
    lines = []
    state = restore(ckdir, *_tiny(), lines.append)
    assert state.step == 0 and state.resumed_from == []
    assert "state.json: " in lines[0] and "optimizer.safetensors: " in lines[1]
    assert lines[-1] == f"warning: no checkpoint under {ckdir} reads back whole; training starts from step 0"


def test_a_whole_checkpoint_of_another_drafter_is_still_refused(tmp_path):
    import mlx.nn as nn
    import mlx.optimizers as optim

    from train.loop import restore

    _checkpoints(tmp_path / "ckpt", 2)
    with pytest.raises(ConfigError, match="checkpoint of another drafter shape"):
        restore(tmp_path / "ckpt", nn.Linear(4, 8), optim.AdamW(learning_rate=1e-3), print)


def test_a_damaged_best_checkpoint_exports_the_last_step_with_a_warning(tmp_path):
    from train.loop import load_best, save_best

    module, _ = _tiny()
    save_best(tmp_path, module, 6)
    assert load_best(tmp_path, module, print) == 6
    (tmp_path / "best" / "weights.safetensors").write_bytes(b"")
    lines = []
    assert load_best(tmp_path, module, lines.append) is None
    assert lines[0].startswith(f"warning: {tmp_path / 'best'} does not read back whole")


# ---------------------------------------------------------------- a machine that refuses a write

def test_a_refused_write_is_one_line_naming_the_file_the_setting_and_the_cure(tmp_path, monkeypatch, capsys):
    """Was: a traceback and "rerun the same command to resume", which a full disk does not cure."""
    import shutil

    from harness import faults
    from train import files
    from train.__main__ import guarded

    faults.name_path(tmp_path, "out")
    target = tmp_path / "ckpt" / "weights.safetensors"

    def full_disk(cfg):
        with files.writing(target):
            raise OSError(errno.ENOSPC, "No space left on device")  # as write() raises it: no file named

    assert guarded(full_disk, None) == 3
    err = capsys.readouterr().err
    assert err == (f"error: {target}: No space left on device (out); free space on that disk, or point the setting "
                   "elsewhere, then rerun\n")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 1 << 20))

    def mlx_writer(cfg):  # MLX's own writer says neither the file nor why
        with files.writing(target):
            raise RuntimeError("[write] Unable to write 391900 bytes to file.")

    assert guarded(mlx_writer, None) == 3
    assert capsys.readouterr().err.startswith(f"error: {target}: [write] Unable to write 391900 bytes to file. (out); "
                                              "free space on that disk")


def test_training_faults_keep_their_codes(capsys):
    from engines.errors import DrafterError, Unsupported
    from train.__main__ import guarded

    def raising(e):
        def run(cfg):
            raise e
        return run

    assert guarded(raising(Unsupported("MTP needs a Qwen3.5 target")), None) == 2
    assert guarded(raising(DrafterError("fc.weight has shape (1, 2)")), None) == 2
    assert capsys.readouterr().err == "error: MTP needs a Qwen3.5 target\nerror: fc.weight has shape (1, 2)\n"
    assert guarded(raising(MemoryError()), None) == 3
    assert capsys.readouterr().err.startswith("error: training ran out of memory; lower train.batch, data.batch")


def test_a_size_limit_while_training_is_exit_3_naming_the_file_and_out(tmp_path):
    """A full disk, as `ulimit -f` makes one: the first checkpoint outgrows it (was: a traceback and
    "rerun the same command to resume"); the partial checkpoint is removed, the data shards stay whole."""
    out, prompts = tmp_path / "o", tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Name {n} birds that live near the coast of a lake.\n" for n in range(2, 12)))
    r = train("train=mtp", "arch=llama", f"out={out}", f"data.prompts={prompts}", *SMALL, "data.max_new_tokens=8",
              prefix="ulimit -f 64")
    assert r.returncode == 3, r.stderr[-2000:]
    line = last_line(r)
    assert line.startswith(f"error: {out / 'ckpt'}/.tmp-") and "weights.safetensors: File too large (out); " in line
    assert line.endswith("the file outgrew a size limit (ulimit -f): lift the limit or point the setting elsewhere")
    assert "Traceback" not in r.stderr and "rerun the same command" not in r.stderr
    assert not list((out / "ckpt").iterdir())  # no partial checkpoint left to resume from
    assert len(list((out / "data").glob("shard-*.jsonl"))) == 2
