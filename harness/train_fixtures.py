"""Train the fixture models once; their weights ship in harness/data/fixtures/.

`python -m harness.train_fixtures [name ...]` starts each fixture from its seeded
random init (harness.fixtures.build_model) and trains it as a language model on the
project's own text, half of the rows ending in a repeat of an earlier span so the
model learns to copy. The result behaves like a (very) small real model: copy-heavy
prompts get high n-gram acceptance, open-ended ones low; random weights would give
near-zero acceptance everywhere and make every speculative method look alike.

Training is seeded; the shipped bytes are the reference (another BLAS would round
differently). Training is fast with OpenBLAS preloaded (README, "Speed on Linux
CPUs"): about 20 minutes for all four fixtures on 2 cores.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from harness import fixtures

STEPS, BATCH, SEQ, LR, WARMUP = 600, 16, 96, 2e-3, 50


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


def train(name: str, tokenizer_path: Path, log=print):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    ids = tok.encode(fixtures.corpus_text()).ids
    sep = tok.encode("\n").ids[0]
    model = fixtures.build_model(name)
    model.train()
    schedule = optim.join_schedules([optim.linear_schedule(LR / 10, LR, WARMUP),
                                     optim.cosine_decay(LR, STEPS - WARMUP, LR / 10)], [WARMUP])
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    step_fn = nn.value_and_grad(model, loss_fn)
    rows = _rows(ids, sep, random.Random(fixtures.SEED))
    t0 = time.perf_counter()
    for step in range(STEPS):
        batch = mx.array([next(rows) for _ in range(BATCH)])  # [B, SEQ + 1]
        loss, grads = step_fn(model, batch[:, :-1], batch[:, 1:])
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if step % 100 == 0 or step == STEPS - 1:
            log(f"{name}: step {step} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f}s)")
    model.eval()
    return model


def main(names: list[str]) -> None:
    from mlx.utils import tree_flatten
    import mlx.core as mx

    out = fixtures.SHIPPED_DIR
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = out / "tokenizer.json"
    if not tokenizer.exists():
        fixtures.train_tokenizer_json(tokenizer)
    for name in names or fixtures.fixture_names():
        model = train(name, tokenizer)
        keep = getattr(model, "cast_predicate", lambda _: True)  # e.g. Qwen3.5's A_log stays float32
        weights = {k: v.astype(mx.bfloat16) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v
                   for k, v in tree_flatten(model.parameters())}
        mx.save_safetensors(str(out / f"{name}.safetensors"), weights)
        print(f"wrote {out / f'{name}.safetensors'}")


if __name__ == "__main__":
    main(sys.argv[1:])
