"""Train the fixture models once; their weights ship in harness/data/fixtures/.

`python -m train.fixtures [target|dflash|mtp|eagle3] [name ...]` (default: everything).

Each fixture target starts from its seeded random init (harness.models.fixtures.build_model)
and learns the project's own text as a language model (train/lm.py), half of the rows ending
in a repeat of an earlier span so the model learns to copy. The result behaves like a (very)
small real model: copy-heavy prompts get high n-gram acceptance, open-ended ones low; random
weights would give near-zero acceptance everywhere and make every speculative method look
alike. Its drafters are then made the way `python -m train` makes real ones: the target
answers corpus prompts greedily (train/data.answer_batch), and train/'s objectives fit each
drafter, in the shape the fixture spec gives (harness.models.fixtures.DFLASH, EAGLE3), to
those answers. Every model trains in train/loop.fit.

Training is seeded; the shipped bytes are the reference (another BLAS would round
differently). How long all four take on 2 cores: docs/models.md.
"""

from __future__ import annotations

from engines.drafters import DRAFTERS
from harness import blas

blas.select()  # before anything imports mlx (harness/blas.py)

import dataclasses  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from engines.drafters.dflash import DFlashConfig  # noqa: E402
from engines.drafters.eagle3 import Eagle3Config, save_eagle3  # noqa: E402
from harness.models import fixtures  # noqa: E402
from train.config import DataConfig, TrainConfig  # noqa: E402
from train.data import Rows, answer_batch  # noqa: E402
from train.dflash import DFlashObjective  # noqa: E402
from train.eagle3 import Eagle3Objective  # noqa: E402
from train.lm import LanguageModelObjective  # noqa: E402
from train.loop import fit, load_best  # noqa: E402
from train.mtp import MTPObjective  # noqa: E402

SEQ = 96  # tokens per target row
PROMPT = (8, 88)  # a drafter row's prompt: the first 8-88 ids of a target row, which the target then answers
ANSWER = 64  # new tokens per answer
DISTILL_ROWS, EVAL_ROWS = 1024, 64
KINDS = ("target", *(k.name for k in DRAFTERS.values() if k.fixture))  # training order: the target first
_FIXED = dict(warmup_ratio=0.08, min_lr_ratio=0.1, weight_decay=0.01, grad_clip=1.0, log_every=100,
              eval_every=250, ckpt_every_steps=10**9, ckpt_every_s=1e9,
              eval_head_tokens=None)  # answers are ANSWER tokens long: their head is the whole answer
CONFIGS = {  # values tuned for these 128-wide models; train/config.py's defaults are for real targets
    "target": TrainConfig(kind="lm", steps=600, batch=16, lr=2e-3, seed=fixtures.SEED, export="last", **_FIXED),
    "dflash": TrainConfig(kind="dflash", steps=800, batch=16, lr=2e-3, seed=fixtures.SEED + 2, num_anchors=16,
                          **_FIXED),
    "mtp": TrainConfig(kind="mtp", steps=800, batch=16, lr=2e-3, seed=fixtures.SEED + 4, **_FIXED),
    "eagle3": TrainConfig(kind="eagle3", steps=500, batch=16, lr=2e-3, seed=fixtures.SEED + 6, ttt_length=4,
                          init_lm_head_from_target=True, **_FIXED),
}


# Fixtures whose DFlash drafter learns the target's choices along whole corpus rows (train.labels=target):
# distilled from answers alone, these two reached tau 1.05-1.10 on the built-in prompts; qwen35's and
# gemma4_moe's, distilled from answers, reached 1.71 and 1.16 over every built-in turn.
DFLASH_LABELS = {"llama": "target", "gemma4": "target"}


def corpus_rows(tokenizer: Tokenizer, n: int, seed: int) -> list[list[int]]:
    """n rows of SEQ + 1 ids: corpus windows, or text ending in a repeat of an earlier span."""
    ids = tokenizer.encode(fixtures.corpus_text()).ids
    sep, rng, rows = tokenizer.encode("\n").ids[0], random.Random(seed), []
    while len(rows) < n:
        if rng.random() < 0.5:
            s = rng.randrange(len(ids) - SEQ - 1)
            rows.append(ids[s: s + SEQ + 1])
            continue
        k = rng.randrange(8, SEQ // 2)
        s = rng.randrange(len(ids) - k)
        span = ids[s: s + k]
        start = rng.randrange(len(ids) - SEQ)
        row = ids[start: start + SEQ + 1 - 2 * k - 1] + span + [sep] + span
        rows.append((row + ids[: SEQ + 1 - len(row)])[: SEQ + 1])
    return rows


def train_target(name: str, tokenizer: Tokenizer, work: Path, log=print):
    """Fixture `name` from its seeded init, trained as a language model on the project text."""
    cfg = CONFIGS["target"]
    rows = corpus_rows(tokenizer, cfg.steps * cfg.batch, fixtures.SEED)
    held = corpus_rows(tokenizer, EVAL_ROWS, fixtures.SEED + 100)
    model = fixtures.build_model(name)
    model.train()
    _fit(LanguageModelObjective(model), Rows(rows, [0] * len(rows)), Rows(held, [0] * len(held)), cfg,
         work / f"{name}.target", log)
    model.eval()
    return model


def _distill_corpus() -> list[list[int]]:
    """The DISTILL_ROWS + EVAL_ROWS corpus rows every fixture's drafters learn from (held-out ones first)."""
    return corpus_rows(Tokenizer.from_file(str(fixtures.SHIPPED_DIR / "tokenizer.json")),
                       DISTILL_ROWS + EVAL_ROWS, fixtures.SEED + 1)


def distill_rows(name: str, target, tokenizer, log=print) -> tuple[Rows, Rows]:
    """(training, held-out) rows: corpus prompts cut at PROMPT ids and the target's greedy answers."""
    rows = _distill_corpus()
    # Cut anywhere: a cut inside a row's repeated span asks the target to copy, as retrieval prompts do.
    cuts = random.Random(fixtures.SEED + 1)
    prompts = [r[:cuts.randrange(PROMPT[0], PROMPT[1] + 1)] for r in rows]
    data = DataConfig(max_new_tokens=ANSWER, temperature=0.0)
    answers = []
    for i in range(0, len(prompts), 128):
        answers += answer_batch(target, tokenizer, prompts[i: i + 128], data, seed=i)
    kept = [(p, a) for p, a in zip(prompts, answers) if len(a) >= 2]  # an answer ending at once teaches nothing
    log(f"{name}: {len(kept)} distillation rows, {sum(len(a) for _, a in kept)} answer tokens")
    ids, plens = [p + a for p, a in kept], [len(p) for p, _ in kept]
    return Rows(ids[EVAL_ROWS:], plens[EVAL_ROWS:]), Rows(ids[:EVAL_ROWS], plens[:EVAL_ROWS])


def corpus_distill_rows() -> tuple[Rows, Rows]:
    """(training, held-out) target rows whole (labels=target: the target's choice at every position
    after the first), copied spans included, as the retrieval prompts copy."""
    rows = _distill_corpus()
    return Rows(rows[EVAL_ROWS:], [1] * DISTILL_ROWS), Rows(rows[:EVAL_ROWS], [1] * EVAL_ROWS)


# A fixture target's answers, made once for all its drafter kinds: (checkpoint dir, whose name carries
# the weights' hash, DISTILL_ROWS, EVAL_ROWS) -> distill_rows' (training, held-out) rows.
_ANSWERED: dict[tuple[str, int, int], tuple[Rows, Rows]] = {}


def train_drafter(kind: str, name: str, work: Path, log=print):
    """The `kind` drafter of fixture `name` (dflash | mtp | eagle3), distilled from the shipped target."""
    ckpt = str(fixtures.fixture_dir(name))
    target, tokenizer = mlx_lm.load(ckpt)
    fixtures.cast_model(target, mx.float32)
    target.eval()
    target.freeze()
    cfg = CONFIGS[kind]
    if kind == "dflash":
        cfg = dataclasses.replace(cfg, labels=DFLASH_LABELS.get(name, "data"))
    if cfg.labels == "target":
        train_rows, held = corpus_distill_rows()
    else:
        key = (ckpt, DISTILL_ROWS, EVAL_ROWS)
        if key not in _ANSWERED:
            _ANSWERED[key] = distill_rows(name, target, tokenizer, log)
        train_rows, held = _ANSWERED[key]
    if kind == "dflash":
        shape = DFlashConfig.from_json(fixtures.DFLASH[name], f"DFLASH[{name}]")
        obj = DFlashObjective(target, tokenizer, cfg, train_rows.ids, train_rows.prompt_lens, shape=shape)
    elif kind == "eagle3":
        shape = Eagle3Config.from_json(fixtures.EAGLE3[name], f"EAGLE3[{name}]")
        obj = Eagle3Objective(target, tokenizer, cfg, train_rows.ids, train_rows.prompt_lens, shape=shape)
    else:
        obj = MTPObjective(target, tokenizer, cfg, train_rows.ids, train_rows.prompt_lens)
    _fit(obj, train_rows, held, cfg, work / f"{name}.{kind}", log)
    return obj.module


def _fit(obj, train_rows: Rows, held: Rows, cfg: TrainConfig, out: Path, log) -> None:
    # train/loop.fit checkpoints under out/ckpt (a scratch directory here); the best held-out step is kept
    fit(obj, (train_rows.ids, train_rows.prompt_lens), (held.ids, held.prompt_lens), cfg, out,
        lambda msg: log(f"{out.name}: {msg}"))
    if cfg.export == "best":
        load_best(out / "ckpt", obj.module)


def _bf16(v):
    return v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v


def _save(weights: dict, path: Path) -> None:
    mx.save_safetensors(str(path), weights)
    print(f"wrote {path}", flush=True)


def save_target(name: str, model, out: Path) -> None:
    keep = getattr(model, "cast_predicate", lambda _: True)  # e.g. Qwen3.5's A_log stays float32
    _save({k: _bf16(v) if keep(k) else v for k, v in tree_flatten(model.parameters())}, out / f"{name}.safetensors")


def save_drafter(kind: str, name: str, module, out: Path) -> None:
    """A drafter in the fixture's shipped form: one safetensors file beside the target's (the
    config comes from the fixture spec), or the MTP head inside the target's checkpoint."""
    if kind == "dflash":
        _save({k: _bf16(v) for k, v in tree_flatten(module.parameters())}, out / f"{name}.dflash.safetensors")
    elif kind == "eagle3":
        with tempfile.TemporaryDirectory(dir=out) as tmp:
            save_eagle3(module, Path(tmp))
            shutil.move(str(Path(tmp) / "model.safetensors"), out / f"{name}.eagle3.safetensors")
        print(f"wrote {out / f'{name}.eagle3.safetensors'}", flush=True)
    else:  # Qwen3.5 releases ship the MTP head inside the target checkpoint (mtp.*); mlx-lm's loader drops it
        path = out / f"{name}.safetensors"
        weights = {k: v for k, v in mx.load(str(path)).items() if not k.startswith("mtp.")}
        weights.update({f"mtp.{k}": _bf16(v) for k, v in tree_flatten(module.parameters())})
        _save(weights, path)


def kinds_for(name: str, kinds: list[str]) -> list[str]:
    """The kinds fixture `name` ships, in training order (an MTP head only on Qwen3.5 fixtures)."""
    mtp = fixtures.FIXTURES[name]["model_type"] == "qwen3_5"
    return [k for k in KINDS if k in kinds and (k != "mtp" or mtp)]


def main(args: list[str]) -> None:
    """python -m train.fixtures [target|dflash|mtp|eagle3] [name ...]  (default: everything)"""
    kinds = [a for a in args if a in KINDS] or list(KINDS)
    names = [a for a in args if a not in kinds] or fixtures.fixture_names()
    out = fixtures.SHIPPED_DIR
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tokenizer.json").exists():
        fixtures.train_tokenizer_json(out / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    with tempfile.TemporaryDirectory(prefix="train-fixtures-") as work:
        for name in names:
            for kind in kinds_for(name, kinds):
                if kind == "target":
                    save_target(name, train_target(name, tokenizer, Path(work)), out)
                else:
                    save_drafter(kind, name, train_drafter(kind, name, Path(work)), out)


if __name__ == "__main__":
    from harness.faults import guarded

    sys.exit(guarded(lambda: main(sys.argv[1:]), "python -m train.fixtures"))
