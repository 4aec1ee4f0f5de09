"""Train the fixture models once; their weights ship in harness/data/fixtures/.

`python -m harness.train_fixtures [name ...]` starts each fixture from its seeded
random init (harness.models.fixtures.build_model) and trains it as a language model on the
project's own text, half of the rows ending in a repeat of an earlier span so the
model learns to copy. The result behaves like a (very) small real model: copy-heavy
prompts get high n-gram acceptance, open-ended ones low; random weights would give
near-zero acceptance everywhere and make every speculative method look alike.

Training is seeded; the shipped bytes are the reference (another BLAS would round
differently). Training is fast with OpenBLAS preloaded (docs/cpu-gpu.md, "Speed on Linux
CPUs"): about 20 minutes for all four fixtures on 2 cores.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from harness.models import fixtures

STEPS, BATCH, SEQ, LR, WARMUP = 600, 16, 96, 2e-3, 50
DRAFT_STEPS = 3000
EAGLE3_STEPS = 1000  # its single-step objective converges fast (loss < 0.01 by step 1000)
KINDS = ("target", "dflash", "mtp", "eagle3")


def _rows(ids: list[int], sep: int, rng: random.Random):
    """Endless training rows of SEQ + 1 ids: corpus windows, or text + a repeated span."""
    while True:
        if rng.random() < 0.5:
            s = rng.randrange(len(ids) - SEQ - 1)
            yield ids[s: s + SEQ + 1]
            continue
        n = rng.randrange(8, SEQ // 2)
        s = rng.randrange(len(ids) - n)
        span = ids[s: s + n]
        start = rng.randrange(len(ids) - SEQ)
        row = ids[start: start + SEQ + 1 - 2 * n - 1] + span + [sep] + span
        yield (row + ids[: SEQ + 1 - len(row)])[: SEQ + 1]


def _schedule(steps: int):
    import mlx.optimizers as optim

    return optim.join_schedules([optim.linear_schedule(LR / 10, LR, WARMUP),
                                 optim.cosine_decay(LR, steps - WARMUP, LR / 10)], [WARMUP])


def train(name: str, tokenizer_path: Path, log=print):
    """Train fixture `name` from its seeded init as a language model on the project text."""
    import mlx.core as mx
    import mlx.nn as nn
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    rows = _rows(tok.encode(fixtures.corpus_text()).ids, tok.encode("\n").ids[0], random.Random(fixtures.SEED))
    model = fixtures.build_model(name)
    model.train()

    def batch():
        b = mx.array([next(rows) for _ in range(BATCH)])  # [B, SEQ + 1]
        return b[:, :-1], b[:, 1:]

    _fit(model, lambda m, x, y: nn.losses.cross_entropy(m(x), y, reduction="mean"), batch, STEPS, name, log)
    model.eval()
    return model


def _fit(module, loss_fn, batch, steps: int, label: str, log, skip=()):
    """AdamW on `module` for `steps` steps of loss_fn(module, *batch()); returns module."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    opt = optim.AdamW(learning_rate=_schedule(steps), weight_decay=0.01)
    step_fn = nn.value_and_grad(module, loss_fn)
    t0 = time.perf_counter()
    for step in range(steps):
        loss, grads = step_fn(module, *batch())
        for key in skip:  # buffers that live in the parameter tree but are not trained
            grads.pop(key, None)
        opt.update(module, grads)
        mx.eval(module.parameters(), opt.state, loss)
        if step % 100 == 0 or step == steps - 1:
            log(f"{label}: step {step} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    return module


def _target(name: str):
    import mlx.core as mx
    import mlx_lm

    model, _ = mlx_lm.load(str(fixtures.fixture_dir(name)))
    fixtures.cast_model(model, mx.float32)
    return model


def _distill_set(model, layer_ids, n_rows: int, log):
    """Corpus rows with the target's layer outputs and greedy next-token choices at every position."""
    # MLX: only after blas.select() (the __main__ block below)
    import mlx.core as mx
    from tokenizers import Tokenizer

    from engines.hidden import capture_hidden

    tok = Tokenizer.from_file(str(fixtures.SHIPPED_DIR / "tokenizer.json"))
    ids = tok.encode(fixtures.corpus_text()).ids
    rows = _rows(ids, tok.encode("\n").ids[0], random.Random(fixtures.SEED + 1))
    xs, hs, preds = [], [], []
    for _ in range(n_rows // BATCH):
        x = mx.array([next(rows)[:SEQ] for _ in range(BATCH)])  # [B, SEQ]
        with capture_hidden(model, layer_ids) as sink:
            logits = model(x)
        hs.append(mx.concatenate(sink, axis=-1))  # [B, SEQ, n * H]
        preds.append(mx.argmax(logits, axis=-1))  # [B, SEQ]: the target's choice for position t + 1
        xs.append(x)
        mx.eval(hs[-1], preds[-1])
    log(f"distillation set: {n_rows} rows of {SEQ} tokens")
    return mx.concatenate(xs), mx.concatenate(hs), mx.concatenate(preds)


def train_dflash(name: str, log=print):
    """Distil a DFlash drafter from fixture `name`: from a block [x_a, mask...] and the
    target's hidden states before a, predict the target's greedy tokens a+1..a+B-1."""
    # MLX: only after blas.select() (the __main__ block below)
    import mlx.core as mx
    import mlx.nn as nn

    from engines.dflash import DFlashConfig, DFlashDrafter
    from engines.hidden import embed, lm_head

    spec = fixtures.DFLASH[name]
    cfg = DFlashConfig.from_json(spec, f"DFLASH[{name}]")
    target = _target(name)
    xs, hs, preds = _distill_set(target, cfg.target_layer_ids, 1024, log)
    mx.random.seed(fixtures.SEED + 2)
    drafter = DFlashDrafter(cfg)
    drafter.set_dtype(mx.float32)
    blk = cfg.block_size

    def loss_fn(d, rows, anchors):
        x = xs[rows]  # [B, SEQ]
        offs = anchors[:, None] + mx.arange(blk)[None]  # [B, blk]
        block = mx.where(mx.arange(blk)[None] == 0, mx.take_along_axis(x, offs, axis=1), cfg.mask_token_id)
        labels = mx.take_along_axis(preds[rows], offs[:, :-1], axis=1)  # target's choices for a+1..a+blk-1
        h = d(embed(target, block), d.project_context(hs[rows]), anchors=anchors)  # [B, blk, H]
        return nn.losses.cross_entropy(lm_head(target, h[:, 1:]), labels, reduction="mean")

    rng = random.Random(fixtures.SEED + 3)
    batch = lambda: (mx.array([rng.randrange(xs.shape[0]) for _ in range(BATCH * 2)]),
                     mx.array([rng.randrange(4, SEQ - blk) for _ in range(BATCH * 2)]))
    return _fit(drafter, loss_fn, batch, DRAFT_STEPS, f"{name}.dflash", log)


def train_mtp(name: str, log=print):
    """Distil the MTP head of fixture `name`: from the target's final-normed state at t
    and the embedding of token t+1, predict the target's choice for token t+2."""
    # MLX: only after blas.select() (the __main__ block below)
    import mlx.core as mx
    import mlx.nn as nn

    from engines.hidden import embed, final_norm, lm_head, num_layers
    from engines.mtp import MTPHead

    target = _target(name)
    xs, hs, preds = _distill_set(target, (num_layers(target) - 1,), 1024, log)
    hs = final_norm(target, hs)
    mx.random.seed(fixtures.SEED + 4)
    head = MTPHead(target)
    head.set_dtype(mx.float32)

    def loss_fn(m, rows):
        x, h = xs[rows], hs[rows]  # [B, SEQ], [B, SEQ, H]
        out = m(embed(target, x[:, 1:]), h[:, :-1])  # position t: (h_t, token t+1)
        return nn.losses.cross_entropy(lm_head(target, out), preds[rows][:, 1:], reduction="mean")

    rng = random.Random(fixtures.SEED + 5)
    batch = lambda: (mx.array([rng.randrange(xs.shape[0]) for _ in range(BATCH)]),)
    return _fit(head, loss_fn, batch, DRAFT_STEPS, f"{name}.mtp", log)


def train_eagle3(name: str, log=print):
    """Distil an EAGLE-3 drafter from fixture `name`: from fused target features at t and
    the embedding of token t+1, predict the target's choice for token t+2 over a draft
    vocabulary of the target's most frequent choices."""
    # MLX: only after blas.select() (the __main__ block below)
    import mlx.core as mx
    import mlx.nn as nn

    from engines.eagle3 import Eagle3Config, Eagle3Drafter
    from engines.hidden import embed

    cfg = Eagle3Config.from_json(fixtures.EAGLE3[name], f"EAGLE3[{name}]")
    target = _target(name)
    xs, hs, preds = _distill_set(target, tuple(i - 1 for i in cfg.aux_layer_ids), 1024, log)
    counts = mx.zeros((cfg.vocab_size,)).at[preds.reshape(-1)].add(1.0)
    draft_vocab = mx.sort(mx.argsort(-counts)[: cfg.draft_vocab_size])  # ascending target ids
    to_draft = mx.full((cfg.vocab_size,), -1, dtype=mx.int32).at[draft_vocab].add(
        mx.arange(cfg.draft_vocab_size, dtype=mx.int32) + 1)  # target id -> draft id, -1 if absent
    mx.random.seed(fixtures.SEED + 6)
    drafter = Eagle3Drafter(cfg)
    drafter.set_dtype(mx.float32)
    drafter.d2t = (draft_vocab - mx.arange(cfg.draft_vocab_size)).astype(mx.int64)

    def loss_fn(d, rows):
        x, f = xs[rows], hs[rows]  # [B, SEQ], [B, SEQ, 3H]
        out = d.step(embed(target, x[:, 1:]), d.fuse(f[:, :-1]), None, 0)  # position t: (f_t, token t+1)
        labels = to_draft[preds[rows][:, 1:]]  # the target's choice for t+2, in draft ids
        ce = nn.losses.cross_entropy(d.lm_head(d.norm(out)), mx.maximum(labels, 0), reduction="none")
        valid = labels >= 0
        return (ce * valid).sum() / valid.sum()

    rng = random.Random(fixtures.SEED + 7)
    batch = lambda: (mx.array([rng.randrange(xs.shape[0]) for _ in range(BATCH)]),)
    return _fit(drafter, loss_fn, batch, EAGLE3_STEPS, f"{name}.eagle3", log, skip=("d2t",))


def _save(weights: dict, path: Path) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(path), weights)
    print(f"wrote {path}", flush=True)


def main(args: list[str]) -> None:
    """python -m harness.train_fixtures [target|dflash|mtp|eagle3] [name ...]  (default: everything)"""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    kinds = [a for a in args if a in KINDS] or list(KINDS)
    names = [a for a in args if a not in kinds] or fixtures.fixture_names()
    out = fixtures.SHIPPED_DIR
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = out / "tokenizer.json"
    if not tokenizer.exists():
        fixtures.train_tokenizer_json(tokenizer)
    bf16 = lambda v: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v
    for name in names:
        if "target" in kinds:
            model = train(name, tokenizer)
            keep = getattr(model, "cast_predicate", lambda _: True)  # e.g. Qwen3.5's A_log stays float32
            _save({k: bf16(v) if keep(k) else v for k, v in tree_flatten(model.parameters())},
                  out / f"{name}.safetensors")
        if "dflash" in kinds:
            drafter = train_dflash(name)
            _save({k: bf16(v) for k, v in tree_flatten(drafter.parameters())}, out / f"{name}.dflash.safetensors")
        if "eagle3" in kinds:
            # MLX: only after blas.select() (the __main__ block below)
            from engines.eagle3 import save_eagle3

            drafter = train_eagle3(name)
            tmp = out / f".{name}.eagle3"
            save_eagle3(drafter, tmp)
            (tmp / "model.safetensors").rename(out / f"{name}.eagle3.safetensors")
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
        if "mtp" in kinds and fixtures.FIXTURES[name]["model_type"] == "qwen3_5":
            # The MTP head ships inside the target checkpoint under its real names (mtp.*),
            # as in Qwen3.5 releases; mlx-lm's loader drops these keys.
            head = train_mtp(name)
            path = out / f"{name}.safetensors"
            weights = {k: v for k, v in mx.load(str(path)).items() if not k.startswith("mtp.")}
            weights.update({f"mtp.{k}": bf16(v) for k, v in tree_flatten(head.parameters())})
            _save(weights, path)


if __name__ == "__main__":
    from harness import blas

    blas.select()  # before mlx loads: see harness/blas.py
    main(sys.argv[1:])
