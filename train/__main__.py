"""`python -m train train=eagle3|dflash|mtp|draft_model arch.model=<target> [overrides]`.

Loads the target, builds (or reuses) the self-distilled data, trains the drafter with
checkpoints (a rerun of the same command resumes), and writes to `out`, at the end or
when stopped early (train.max_seconds, train.stop_after, SIGTERM: the drafter as of that step,
its record marked incomplete): the drafter in its
published layout (config.json + model.safetensors), training.json (config, data hash,
steps, wall time, final losses, held-out accuracy per position) and curves.png. The export
is read back through the engine's own strict loader before the command reports success.

Before Hydra makes `out`, the command line is composed and every setting checked (numbers finite
and in range, out, data.cache_dir and the harness home writable, named files there); once the
target loads, the objective checks the ids and sizes it takes from it, and train.init is read,
all before the data step makes or reads anything. What escapes leaves through the fault boundary
(harness/faults.py). Exit codes: 0 trained (or stopped early on purpose, resumable), 2 bad input
(one line naming the setting; nothing written), 3 the machine refused a write (one line naming the
file, the setting and the cure) or a failure of the code (its traceback, then one line), 130
interrupted.
"""

from __future__ import annotations

import importlib

from harness import blas

blas.select()  # before anything imports mlx (harness/blas.py)

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from engines.errors import DrafterError, Unsupported  # noqa: E402
from harness import faults  # noqa: E402
from harness.config import check_out_dir, conf_dir  # noqa: E402
from harness.env import environment  # noqa: E402
from harness.errors import ConfigError, TargetError  # noqa: E402
from harness.faults import checked_home  # noqa: E402
from harness.flags import ONLY_ONE, compose_first_job  # noqa: E402
from harness.models.resolve import resolve_model  # noqa: E402
from train.config import from_composed, register, validate  # noqa: E402
from train.files import write_text_atomic, writing  # noqa: E402

APP = "training"  # "training failed: ..." for a failure of the code
KEPT = "what was written is kept (data shards, checkpoints): rerun the same command to resume"
MADE_BY_RUN: list[Path] = []  # folders `out` needed that did not exist before this command, leaf first


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# drafter kind (engines/drafters DRAFTERS) -> its training objective, imported when a run needs it (MLX, mlx-lm)
OBJECTIVES = {"eagle3": "train.eagle3:Eagle3Objective", "dflash": "train.dflash:DFlashObjective",
              "mtp": "train.mtp:MTPObjective", "draft_model": "train.draft_model:DraftModelObjective"}


def objective_for(kind: str):
    module, cls = OBJECTIVES[kind].split(":")
    return getattr(importlib.import_module(module), cls)


def split_rows(rows, n_eval: int, seed: int):
    """((train ids, prompt lens), (eval ids, prompt lens)): a seeded held-out split of rows."""
    order = random.Random(seed).sample(range(len(rows.ids)), len(rows.ids))
    pick = lambda idx: ([rows.ids[i] for i in idx], [rows.prompt_lens[i] for i in idx])
    n_eval = min(n_eval, len(order) - 1)
    return pick(order[n_eval:]), pick(order[:n_eval])


def hold_out_lock(out: Path):
    """An exclusive lock on out/.train.lock for as long as the returned file stays open, or
    ConfigError naming the process that holds it: two trainings into one `out` would interleave
    checkpoints and overwrite each other's export."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    f = open(out / ".train.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ConfigError(f"out={out} is being written by another training ({holder}); wait for it to end, "
                          "or pass another out") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}")
    f.flush()
    return f


def train(cfg) -> int:
    """One training job; returns the exit code."""
    import mlx.core as mx

    # These load MLX and mlx-lm, which this module leaves to the run: bad input answers without them.
    from harness.models.load import load_target
    from train import data
    from train.loop import fit, load_best, plot

    validate(cfg)
    out = Path(cfg.out).expanduser()
    cache = Path(cfg.data.cache_dir).expanduser() if cfg.data.cache_dir else out / "data"
    name_paths(cfg, out)
    if cfg.train.memory_limit_gb:  # processes sharing a GPU each keep freed buffers cached unless told not to
        mx.set_memory_limit(int(cfg.train.memory_limit_gb * 2**30))
        mx.set_cache_limit(int(cfg.train.memory_limit_gb * 2**30 / 10))
    t0 = time.perf_counter()
    ckpt = resolve_model(cfg.arch.model, cfg.arch.dtype, cfg.arch.gguf_dequantize, log)
    target, tokenizer = load_target(ckpt, cfg.arch.dtype)
    target.eval()
    target.freeze()
    objective = objective_for(cfg.train.kind)
    check_before_data(objective, target, tokenizer, cfg.train)
    lock = hold_out_lock(out)  # noqa: F841 -- held until this process ends
    rows, data_info = data.build(target, tokenizer, ckpt, cfg.data, cache, log)
    if rows is None or cfg.data.stop_after == "answers":
        if rows is not None:
            log(f"data: {len(rows.ids)} rows, {rows.answer_tokens()} answer tokens in {data_info['cache']} "
                "(data.stop_after=answers)")
        return 0
    train_rows, eval_rows = split_rows(rows, cfg.data.eval_rows, cfg.data.seed)
    log(f"data: {len(train_rows[0])} training rows, {len(eval_rows[0])} held out, "
        f"{rows.answer_tokens()} answer tokens")
    obj = objective(target, tokenizer, cfg.train, *train_rows)
    init = obj.warm_start(Path(cfg.train.init)) if cfg.train.init else None
    if init:
        log(f"train {cfg.train.kind}: starting from {init['path']} ({'dequantized ' if init['quantized'] else ''}"
            "weights; a fresh optimizer and schedule)")
    state, stopped = fit(obj, train_rows, eval_rows, cfg.train, out, log)
    plot(state.history, out / "curves.png", f"{cfg.arch.name} {cfg.train.kind}")
    exported = state.step
    if cfg.train.export == "best":  # a small dataset overfits: ship the step that generalised best
        exported = load_best(out / "ckpt", obj.module, log) or state.step
        if exported != state.step:
            log(f"train {cfg.train.kind}: exporting step {exported} (lowest held-out loss; train.export=last for the final step)")
    with writing(out):  # the engines' writers name no file when the disk refuses
        obj.export(obj.module, out, getattr(mx, cfg.train.save_dtype))
    obj.load(out)  # the engine's strict loader reads back what was written, or this raises
    record = {"kind": cfg.train.kind, "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
              "target": {"spec": cfg.arch.model, "checkpoint": str(ckpt), "dtype": cfg.arch.dtype},
              "drafter": obj.describe(), "init": init, "data": data_info, "steps": state.step,
              "complete": stopped is None, "stopped_by": stopped, "resumed_from": state.resumed_from,
              "exported_step": exported, "exported_eval": _at(state.history, exported),
              "train_seconds": round(state.elapsed_s, 1), "wall_seconds_this_run": round(time.perf_counter() - t0, 1),
              "final": _final(state.history), "history": state.history,
              "weights_sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(),
              "env": environment()}
    write_text_atomic(out / "training.json", json.dumps(record, indent=1, default=str))
    what = "" if stopped is None else f" as of step {state.step}/{cfg.train.steps}; rerun to continue"
    log(f"train {cfg.train.kind}: wrote {out} (config.json, model.safetensors, training.json, curves.png){what}")
    return 0


def name_paths(cfg, out: Path) -> None:
    """Tell the fault boundary which setting chose each folder, so an OS error's line names it."""
    faults.name_path(out, "out")
    if cfg.data.cache_dir:
        faults.name_path(cfg.data.cache_dir, "data.cache_dir")
    checked_home()  # names SPEC_HARNESS_HOME for the converted models under it


def check_before_data(objective, target, tokenizer, cfg) -> None:
    """Everything that needs the target but no data, so a refusal leaves no data cache: the ids and
    sizes the objective takes from the target, and train.init read as this drafter (a drafter built
    without rows; the one that trains is built again once the rows are there)."""
    objective.check(target, cfg)
    if cfg.init:
        objective(target, tokenizer, cfg, [], []).warm_start(Path(cfg.init))


def _at(history: list, step: int) -> dict | None:
    h = next((h for h in history if h["split"] == "eval" and h["step"] == step), None)
    return h and _rounded(h)


def _rounded(h: dict) -> dict:
    out = {"loss": round(h["loss"], 5), "acc": [round(a, 4) for a in h["acc"]]}
    if "acc_head" in h:
        out.update(acc_head=[round(a, 4) for a in h["acc_head"]], head_tokens=h["head_tokens"])
    return out


def _final(history: list) -> dict:
    last = lambda split: next((h for h in reversed(history) if h["split"] == split), None)
    out = {}
    for split in ("train", "eval"):
        h = last(split)
        if h:
            out[split] = {"step": h["step"], **_rounded(h)}
    return out


@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="training")
def _hydra_main(cfg: DictConfig) -> None:
    code = guarded(train, OmegaConf.to_object(cfg))
    if code == faults.EXIT["bad input"]:
        _drop_made_folders()
    sys.exit(code)


def guarded(run, cfg) -> int:
    """run(cfg) inside the fault boundary (harness/faults.py), with training's words: a drafter or
    target that does not fit is bad input (2), running out of memory names training's sizes."""
    return faults.guarded(lambda: _in_training_terms(run, cfg), APP, KEPT)


def _in_training_terms(run, cfg) -> int:
    try:
        return run(cfg)
    except (DrafterError, TargetError, Unsupported) as e:
        raise ConfigError(str(e)) from None
    except MemoryError:
        raise faults.Fault("training ran out of memory; lower train.batch, data.batch or data.max_len, or give it "
                           "more (train.memory_limit_gb)") from None


def preflight(args: list[str]) -> None:
    """Everything checked before Hydra makes `out` (a refusal here writes nothing): the command
    composes, every setting is in range, and out, data.cache_dir and the harness home take files."""
    cfg = from_composed(compose_first_job("training", args))
    validate(cfg)
    out = Path(str(cfg.out)).expanduser()
    MADE_BY_RUN.extend(p for p in [out, *out.parents] if not p.exists())
    check_out_dir(str(cfg.out), "out", "out=drafters/mine")  # Hydra makes `out` its run folder before the job
    if cfg.data.cache_dir:
        check_out_dir(cfg.data.cache_dir, "data.cache_dir", "data.cache_dir=drafters/data")
    checked_home()
    if cfg.data.prompts not in (None, "magpie", "sharegpt"):  # decoded now: a bad byte is one line, before any load
        from train.data import read_prompt_file

        read_prompt_file(Path(cfg.data.prompts).expanduser())


def _drop_made_folders() -> None:
    """Remove the folders Hydra made for `out` when the run stopped on bad input, as long as nothing
    but this run's lock file is in them."""
    for p in MADE_BY_RUN:
        try:
            if [f.name for f in p.iterdir()] == [".train.lock"]:
                (p / ".train.lock").unlink()
            p.rmdir()
        except OSError:
            return  # not empty, or not there


def main() -> None:
    register()
    code = faults.guarded(lambda: preflight(sys.argv[1:]), APP, "nothing ran")
    if code:
        sys.exit(code)
    try:
        _hydra_main()
    except SystemExit as e:
        if e.code == 1:  # Hydra's own failure outside the job (it printed why): 1 is reserved for a gate's bound
            sys.exit(faults.EXIT["failed"])
        raise
    except ValueError as e:  # Hydra's refusal of flags that exclude each other (-m with --cfg): one line
        if not str(e).startswith(ONLY_ONE):
            raise
        print(f"error: {e} (Hydra's rule)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
