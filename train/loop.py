"""The training loop every objective shares: AdamW with warmup + cosine decay, gradient
clipping, progress with ETA, held-out per-position accuracy, curves, and checkpoints that
make a killed run resume where its last checkpoint left it.

Resumption is exact: a step's rows and its random draws (DFlash anchors) are functions of
(seed, step), and a checkpoint holds the weights, the optimizer state (AdamW moments and
step), the history and the elapsed time; an interrupted run resumed reaches bitwise the
weights of an uninterrupted one. Checkpoints are written to a temp dir and renamed, so a
kill mid-write leaves the previous one intact; one damaged after the fact (a disk fault, a copy
cut short) is named in a warning and set aside, and the newest older one that reads back whole
is used (none: the run starts from step 0 and says so).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from harness.errors import ConfigError
from train.files import save_tensors, writing

KEEP = 2  # checkpoints kept


class Damaged(Exception):
    """A checkpoint that does not read back whole (the message says what failed)."""


@dataclass
class State:
    step: int = 0
    elapsed_s: float = 0.0  # training time across every run of this job
    history: list = field(default_factory=list)  # {"step", "split": train|eval, "loss", "acc": [P], "lr"}
    resumed_from: list = field(default_factory=list)  # steps earlier runs stopped at


def schedule(cfg):
    warm = int(cfg.steps * cfg.warmup_ratio)
    decay = optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * cfg.min_lr_ratio)
    if warm == 0:
        return decay
    return optim.join_schedules([optim.linear_schedule(cfg.lr / 100, cfg.lr, warm), decay], [warm])


class Batches:
    """Rows of step s: an epoch-wise seeded permutation, so any step's rows are known up front."""

    def __init__(self, rows, prompt_lens, batch: int, seed: int):
        self.rows, self.plens, self.batch, self.seed, self._perm = rows, prompt_lens, batch, seed, {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._perm:
            self._perm = {epoch: random.Random(self.seed * 7919 + epoch).sample(range(len(self.rows)), len(self.rows))}
        return self._perm[epoch]

    def at(self, step: int):
        n = len(self.rows)
        idx = [self._order(g // n)[g % n] for g in range(step * self.batch, (step + 1) * self.batch)]
        return [self.rows[i] for i in idx], [self.plens[i] for i in idx]


def fit(obj, train_rows, eval_rows, cfg, out: Path, log) -> tuple[State, str | None]:
    """Train obj.module for cfg.steps (resuming from out/ckpt); returns (state, why it stopped
    early: None when every step ran)."""
    module, ckdir = obj.module, out / "ckpt"
    opt = optim.AdamW(learning_rate=schedule(cfg), betas=[0.9, 0.95], weight_decay=cfg.weight_decay)
    state = restore(ckdir, module, opt, log)
    batches = Batches(*train_rows, cfg.batch, cfg.seed)
    step_fn = nn.value_and_grad(module, obj.loss)
    stop = _stop_on_signal()
    t0, last_ckpt, window = time.perf_counter(), time.perf_counter(), []
    start_step, start_elapsed = state.step, state.elapsed_s
    while state.step < cfg.steps:
        b = obj.batch(*batches.at(state.step), random.Random(cfg.seed * 1_000_003 + state.step))
        (loss, metrics), grads = step_fn(module, b)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(module, grads)
        mx.eval(module.parameters(), opt.state, loss, metrics)
        state.step += 1
        if state.step == start_step + 1:
            log(f"train {obj.kind}: first step done, peak device memory {mx.get_peak_memory() / 2**30:.1f} GiB")
        state.elapsed_s = start_elapsed + time.perf_counter() - t0
        window.append((loss.item(), metrics["acc"].tolist()))
        if state.step % cfg.log_every == 0 or state.step == cfg.steps:
            _log_train(state, window, opt, cfg, start_step, start_elapsed, obj.kind, log)
            window = []
        if state.step % cfg.eval_every == 0 or state.step == cfg.steps:
            if _log_eval(state, obj, eval_rows, cfg, log):
                save_best(ckdir, module, state.step)
        why = _stop_reason(state, cfg, stop, start_elapsed)
        if why or state.step % cfg.ckpt_every_steps == 0 or time.perf_counter() - last_ckpt > cfg.ckpt_every_s:
            save(ckdir, module, opt, state)
            last_ckpt = time.perf_counter()
        if why:
            log(f"train {obj.kind}: stopped at step {state.step}/{cfg.steps} ({why}); rerun the same command to resume")
            return state, why
    if not (ckdir / _name(state.step)).exists():
        save(ckdir, module, opt, state)
    return state, None


def _stop_reason(state: State, cfg, stop: dict, start_elapsed: float) -> str | None:
    if stop["signal"]:
        return f"signal {stop['signal']}"
    if cfg.stop_after is not None and state.step >= cfg.stop_after and state.step < cfg.steps:
        return f"train.stop_after={cfg.stop_after}"
    if cfg.max_seconds is not None and state.elapsed_s - start_elapsed >= cfg.max_seconds and state.step < cfg.steps:
        return f"train.max_seconds={cfg.max_seconds:g} of training in this run"
    return None


def _stop_on_signal() -> dict:
    """SIGTERM / SIGINT finish the step, checkpoint and stop (a second one kills at once)."""
    flag = {"signal": None}

    def handler(signum, frame):
        if flag["signal"]:
            raise KeyboardInterrupt
        flag["signal"] = signal.Signals(signum).name

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return flag


def _log_train(state, window, opt, cfg, start_step, start_elapsed, kind, log) -> None:
    loss = sum(w[0] for w in window) / len(window)
    acc = [sum(w[1][i] for w in window) / len(window) for i in range(len(window[0][1]))]
    lr = float(opt.learning_rate.item()) if isinstance(opt.learning_rate, mx.array) else float(opt.learning_rate)
    state.history.append({"step": state.step, "split": "train", "loss": loss, "acc": acc, "lr": lr})
    rate = (state.step - start_step) / max(state.elapsed_s - start_elapsed, 1e-9)
    eta = (cfg.steps - state.step) / max(rate, 1e-9)
    log(f"train {kind}: step {state.step}/{cfg.steps} loss {loss:.4f} acc {_fmt(acc)} lr {lr:.2e} "
        f"{rate:.2f} step/s eta {_duration(eta)}")


def _log_eval(state, obj, eval_rows, cfg, log) -> bool:
    """Logs the held-out loss and accuracy (and, with train.eval_head_tokens, the accuracy over each
    answer's first N tokens); True when the loss is the lowest so far."""
    rows, plens = eval_rows
    if not rows:
        return False
    loss, acc = held_out(obj, rows, plens, cfg)
    best = min((h["loss"] for h in state.history if h["split"] == "eval"), default=float("inf"))
    entry = {"step": state.step, "split": "eval", "loss": loss, "acc": acc}
    head = ""
    if cfg.eval_head_tokens:  # a bench drafts on an answer's first tokens, harder than whole answers' average
        entry["acc_head"] = held_out(obj, answer_heads(rows, plens, cfg.eval_head_tokens), plens, cfg)[1]
        entry["head_tokens"] = cfg.eval_head_tokens
        head = f", first {cfg.eval_head_tokens} answer tokens {_fmt(entry['acc_head'])}"
    state.history.append(entry)
    log(f"eval {obj.kind}: step {state.step} loss {loss:.4f} acc {_fmt(acc)}{head} (held-out rows)")
    return loss < best


def held_out(obj, rows, plens, cfg) -> tuple[float, list[float]]:
    """Loss and per-position accuracy over `rows`, weighted by the positions each batch scores."""
    total, accs, n = 0.0, None, 0.0
    for i in range(0, len(rows), cfg.batch):
        b = obj.batch(rows[i:i + cfg.batch], plens[i:i + cfg.batch], random.Random(cfg.seed + i))
        loss, m = obj.loss(obj.module, b)
        w = float(m["n"].item())
        total += loss.item() * w
        accs = m["acc"] * w if accs is None else accs + m["acc"] * w
        n += w
    return total / max(n, 1e-9), (accs / max(n, 1e-9)).tolist()


def answer_heads(rows: list, plens: list, n: int) -> list:
    """Each row cut after its answer's first n tokens (prompt_len + n ids): labels only among them."""
    return [r[:p + n] for r, p in zip(rows, plens)]


def _fmt(acc: list[float]) -> str:
    return "[" + " ".join(f"{a:.2f}" for a in acc[:8]) + (" ..." if len(acc) > 8 else "") + "]"


def _duration(s: float) -> str:
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m" if s >= 3600 else f"{int(s // 60)}m{int(s % 60):02d}s"


# ---------------------------------------------------------------- checkpoints

def _name(step: int) -> str:
    return f"step-{step:07d}"


def _replace_dir(final: Path, fill) -> None:
    """`final` written by fill(tmp) into a temp dir beside it and renamed over it, so a kill
    mid-write leaves the previous one intact; a failed write removes the temp dir (space it held)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        fill(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def save(ckdir: Path, module, opt, state: State) -> Path:
    """Weights, optimizer state and loop state of `state.step`, atomically; older ones pruned."""
    def fill(tmp: Path) -> None:
        save_tensors(tmp / "weights.safetensors", dict(tree_flatten(module.parameters())))
        save_tensors(tmp / "optimizer.safetensors", dict(tree_flatten(opt.state)))
        with writing(tmp / "state.json"):
            (tmp / "state.json").write_text(json.dumps(state.__dict__))

    final = ckdir / _name(state.step)
    _replace_dir(final, fill)
    for old in _checkpoints(ckdir)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _checkpoints(ckdir: Path) -> list[Path]:
    """ckdir's step-* folders, oldest first (each renamed into place whole)."""
    return sorted(p for p in ckdir.glob("step-*") if p.is_dir()) if ckdir.is_dir() else []


def save_best(ckdir: Path, module, step: int) -> None:
    """The weights of the lowest held-out loss so far (ckdir/best), atomically."""
    def fill(tmp: Path) -> None:
        save_tensors(tmp / "weights.safetensors", dict(tree_flatten(module.parameters())))
        with writing(tmp / "step.json"):
            (tmp / "step.json").write_text(json.dumps({"step": step}))

    _replace_dir(ckdir / "best", fill)


def load_best(ckdir: Path, module, log=print) -> int | None:
    """Loads ckdir/best into module; its step, or None when no eval has run or it does not read back
    whole (named in a warning: the caller exports the weights it has)."""
    best = ckdir / "best"
    if not (best / "step.json").exists():
        return None
    try:
        weights = _read_tensors(best / "weights.safetensors")
        _check_shapes(weights, dict(tree_flatten(module.parameters())), best)
        step = json.loads((best / "step.json").read_text())["step"]
    except (Damaged, OSError, ValueError, KeyError, TypeError) as e:
        log(f"warning: {best} does not read back whole ({_first_line(e)}); exporting the last step's weights")
        return None
    module.load_weights(list(weights.items()))
    mx.eval(module.parameters())
    return step


def _check_shapes(saved: dict, have: dict, where: Path) -> None:
    """ConfigError unless checkpoint `where` holds exactly this drafter's tensors, shape for shape
    (a run resumed into an `out` that another drafter shape trained in)."""
    if set(saved) != set(have):
        odd = sorted(set(saved) ^ set(have))[0]
        raise ConfigError(f"{where} is a checkpoint of another drafter ({odd} is in one and not the other): pass "
                          "another out, or delete its ckpt/ folder to start this drafter from step 0")
    for k, v in have.items():
        if saved[k].shape != v.shape:
            raise ConfigError(f"{where} is a checkpoint of another drafter shape ({k}: {tuple(saved[k].shape)} saved, "
                              f"{tuple(v.shape)} now): pass another out, or delete its ckpt/ folder to start over")


def restore(ckdir: Path, module, opt, log) -> State:
    """The newest checkpoint that reads back whole, loaded into module and opt, or a fresh State.
    A damaged one is named in a warning and set aside (ckdir/damaged-step-N) and the next older one
    tried; ConfigError when a whole one is of another drafter's shape."""
    mine = dict(tree_flatten(module.parameters()))
    damaged = []
    for path in reversed(_checkpoints(ckdir)):
        try:
            weights, opt_state, state = _read_checkpoint(path)
        except Damaged as e:
            damaged.append(_set_aside(path))
            log(f"warning: checkpoint {path} is damaged ({e}); moved to {damaged[-1].name}, trying an older one")
            continue
        _check_shapes(weights, mine, path)
        module.load_weights(list(weights.items()))
        opt.state = tree_unflatten(list(opt_state.items()))
        state.resumed_from.append(state.step)
        mx.eval(module.parameters(), opt.state)
        log(f"train: resumed from {path} (step {state.step}, {state.elapsed_s:.0f} s trained so far)")
        return state
    if damaged:
        log(f"warning: no checkpoint under {ckdir} reads back whole; training starts from step 0")
    return State()


def _read_checkpoint(path: Path) -> tuple[dict, dict, State]:
    """(weights, optimizer state, loop state) of checkpoint `path`, or Damaged saying what failed."""
    weights = _read_tensors(path / "weights.safetensors")
    opt_state = _read_tensors(path / "optimizer.safetensors")
    try:
        state = State(**json.loads((path / "state.json").read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise Damaged(f"state.json: {_first_line(e)}") from None
    if not isinstance(state.step, int) or state.step < 0 or not isinstance(state.history, list):
        raise Damaged("state.json holds no step count and history")
    return weights, opt_state, state


def _read_tensors(file: Path) -> dict:
    """Every tensor of a safetensors file, read now; Damaged when it is missing, cut short or not one."""
    try:
        arrays = mx.load(str(file))
        mx.eval(arrays)
    except (OSError, ValueError, RuntimeError) as e:
        raise Damaged(f"{file.name}: {_first_line(e)}") from None
    if not isinstance(arrays, dict):
        raise Damaged(f"{file.name}: not a safetensors file")
    return arrays


def _set_aside(path: Path) -> Path:
    """`path` renamed out of the step-* names, so neither resuming nor pruning counts it again."""
    aside = path.with_name(f"damaged-{path.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    return aside


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


# ---------------------------------------------------------------- curves

def plot(history: list, path: Path, title: str) -> None:
    """Loss (train, held-out) and held-out accuracy per draft position against step, as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for split, style in (("train", "-"), ("eval", "o-")):
        pts = [(h["step"], h["loss"]) for h in history if h["split"] == split]
        if pts:
            ax1.plot(*zip(*pts), style, label=split, markersize=3)
    ax1.set(xlabel="step", ylabel="loss", title=f"{title}: loss")
    ax1.legend()
    evals = [h for h in history if h["split"] == "eval"] or [h for h in history if h["split"] == "train"]
    for k in range(len(evals[0]["acc"]) if evals else 0):
        line, = ax2.plot([h["step"] for h in evals], [h["acc"][k] for h in evals], "o-", markersize=3,
                         label=f"pos {k + 1}")
        heads = [(h["step"], h["acc_head"][k]) for h in evals if "acc_head" in h]
        if heads:  # the same position over answers' first tokens: dotted, in the same colour
            ax2.plot(*zip(*heads), ":", color=line.get_color())
    ax2.set(xlabel="step", ylabel="accuracy (argmax = target's)", ylim=(0, 1),
            title="held-out accuracy per position (dotted: answers' first tokens)")
    if evals:
        ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        with writing(tmp):
            fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        plt.close(fig)
