"""`python -m train train=eagle3|dflash|mtp|draft_model arch.model=<target> [overrides]`.

Loads the target, builds (or reuses) the self-distilled data, trains the drafter with
checkpoints (a rerun of the same command resumes), and writes to `out`, at the end or
when stopped early (train.max_seconds, train.stop_after, SIGTERM: the drafter as of that step,
its record marked incomplete): the drafter in its
published layout (config.json + model.safetensors), training.json (config, data hash,
steps, wall time, final losses, held-out accuracy per position) and curves.png. The export
is read back through the engine's own strict loader before the command reports success.

Exit codes: 0 trained (or stopped early on purpose, resumable), 2 bad input.
"""

from __future__ import annotations

from harness import blas

blas.select()  # before anything imports mlx (harness/blas.py)

import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from engines.errors import DrafterError, Unsupported  # noqa: E402
from harness.config import check_out_dir, conf_dir  # noqa: E402
from harness.env import environment  # noqa: E402
from harness.errors import ConfigError, TargetError  # noqa: E402
from harness.flags import ONLY_ONE, compose_first_job  # noqa: E402
from harness.models.resolve import resolve_model  # noqa: E402
from train.config import register, validate  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def objective_for(kind: str):
    # Each objective loads MLX and mlx-lm, which this module leaves to the run.
    from train.dflash import DFlashObjective
    from train.draft_model import DraftModelObjective
    from train.eagle3 import Eagle3Objective
    from train.mtp import MTPObjective

    return {"eagle3": Eagle3Objective, "dflash": DFlashObjective, "mtp": MTPObjective,
            "draft_model": DraftModelObjective}[kind]


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
    if cfg.train.memory_limit_gb:  # processes sharing a GPU each keep freed buffers cached unless told not to
        mx.set_memory_limit(int(cfg.train.memory_limit_gb * 2**30))
        mx.set_cache_limit(int(cfg.train.memory_limit_gb * 2**30 / 10))
    t0 = time.perf_counter()
    out = Path(cfg.out).expanduser()
    lock = hold_out_lock(out)  # noqa: F841 -- held until this process ends
    ckpt = resolve_model(cfg.arch.model, cfg.arch.dtype, cfg.arch.gguf_dequantize, log)
    target, tokenizer = load_target(ckpt, cfg.arch.dtype)
    target.eval()
    target.freeze()
    objective = objective_for(cfg.train.kind)
    objective.check(target)
    rows, data_info = data.build(target, tokenizer, ckpt, cfg.data, Path(cfg.data.cache_dir or out / "data"), log)
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
        exported = load_best(out / "ckpt", obj.module) or state.step
        if exported != state.step:
            log(f"train {cfg.train.kind}: exporting step {exported} (lowest held-out loss; train.export=last for the final step)")
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
    tmp = out / ".training.json.tmp"
    tmp.write_text(json.dumps(record, indent=1, default=str))
    tmp.replace(out / "training.json")
    what = "" if stopped is None else f" as of step {state.step}/{cfg.train.steps}; rerun to continue"
    log(f"train {cfg.train.kind}: wrote {out} (config.json, model.safetensors, training.json, curves.png){what}")
    return 0


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
    sys.exit(guarded(train, OmegaConf.to_object(cfg)))


def guarded(run, cfg) -> int:
    """run(cfg)'s exit code, with the benchmark's codes for what goes wrong: 2 bad input (one
    line), 3 a failure while training (its traceback, then one line), 130 interrupted."""
    try:
        return run(cfg)
    except (ConfigError, DrafterError, TargetError, Unsupported) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; what was written is kept (data rounds, checkpoints): rerun the same command to "
              "resume", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 -- the traceback for whoever debugs it, then the one line
        traceback.print_exc()
        print("error: training failed (traceback above); checkpoints already under out/ckpt are kept: rerun the "
              "same command to resume", file=sys.stderr)
        return 3


def main() -> None:
    register()
    try:  # compose once up front (a sweep's first job): a typo or a wrong type is one line and exit 2
        composed = compose_first_job("training", sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:  # Hydra makes `out` its run folder before the job: a file there would be its traceback
        check_out_dir(str(composed.out), "out", "out=drafters/mine")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        _hydra_main()
    except ValueError as e:  # Hydra's refusal of flags that exclude each other (-m with --cfg): one line
        if not str(e).startswith(ONLY_ONE):
            raise
        print(f"error: {e} (Hydra's rule)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
