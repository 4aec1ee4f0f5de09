"""Teacher-forced accuracy of the draft LM: on held-out training rows and on the bench's own outputs.

    python docs/benchmarks/2026-12-05-smollm2-run6/teacher_forced.py [N_ROWS] [Q8_DIR]

Run from the repo root. The held-out split is the trainer's own (train/__main__.py split_rows),
and Q8_DIR is an 8-bit copy of the drafter; run 6's copy came back from the device and is not
in the repo. The bench outputs come from the 4-bit draft_model record in records.tgz beside this script.
"""
import json, sys, tarfile
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from train.__main__ import split_rows  # noqa: E402  (selects the BLAS before mlx loads)
import numpy as np
import mlx.core as mx
from harness.models.resolve import resolve_model
from harness.models.load import load_target
from harness.prompts import load_suite, encode_turn
from engines.target import Target
from engines.draft_model import load_draft_model

ckpt = resolve_model('smollm2', 'float32')
model, tok = load_target(ckpt, 'float32')
paths = {'q4': REPO / 'harness/data/drafters/smollm2/draft_model'}
if len(sys.argv) > 2:
    paths['q8'] = Path(sys.argv[2])
drafts = {q: load_draft_model(p, Target(model))[0] for q, p in paths.items()}

def argmax(m, ids):
    return np.array(mx.argmax(m(mx.array([ids]))[0], axis=-1))

# held-out rows, split as the trainer splits them (data.eval_rows=128, data.seed=0)
d = np.load(REPO / 'docs/benchmarks/2026-12-04-smollm2-run5/data.npz')
ids, b = d['ids'].astype(np.int64), d['bounds']
pairs = [(ids[b[2*i]:b[2*i+1]].tolist(), ids[b[2*i+1]:b[2*i+2]].tolist()) for i in range((len(b) - 1) // 2)]
_, (held_ids, held_lens) = split_rows(SimpleNamespace(ids=[p + a for p, a in pairs], prompt_lens=[len(p) for p, _ in pairs]), 128, 0)
held = [(r[:n], r[n:]) for r, n in zip(held_ids, held_lens)][:int(sys.argv[1]) if len(sys.argv) > 1 else 40]

def acc(pairs, first_n=None):
    out = {k: [0, 0] for k in ['target_vs_label', *[f'{q}_vs_label' for q in drafts], *[f'{q}_vs_target' for q in drafts]]}
    for p, a in pairs:
        a = a[:first_n] if first_n else a
        seq = (p + a)[:640]
        n_ans = len(seq) - len(p)
        if n_ans < 2: continue
        lab = np.array(seq[len(p):])                          # the answer tokens
        sl = slice(len(p) - 1, len(seq) - 1)                  # positions predicting them
        t = argmax(model, seq)[sl]
        out['target_vs_label'][0] += (t == lab).sum(); out['target_vs_label'][1] += n_ans
        for q, m in drafts.items():
            g = argmax(m, seq)[sl]
            out[f'{q}_vs_label'][0] += (g == lab).sum(); out[f'{q}_vs_label'][1] += n_ans
            out[f'{q}_vs_target'][0] += (g == t).sum(); out[f'{q}_vs_target'][1] += n_ans
    return {k: round(v[0] / max(1, v[1]), 3) for k, v in out.items()}

print('held-out rows, all answer tokens', acc(held), flush=True)
print('held-out rows, first 64 answer tokens', acc(held, 64), flush=True)

# the bench's own first turns: prompt ids re-encoded, outputs from the record (lossless: base's)
with tarfile.open(Path(__file__).with_name('records.tgz')) as tar:
    rec = json.load(tar.extractfile(next(m for m in tar if 'smollm2__draft_model' in m.name)))
suite = {p.id: p for p in load_suite('mtbench+humaneval+gsm8k')}
pairs = []
for it in rec['prompts']:
    if it['turn'] != 0: continue
    pid = encode_turn(tok, suite[it['id']], 0, [], True, ())
    assert len(pid) == it['prompt_tokens'], (len(pid), it['prompt_tokens'])
    pairs.append((pid, it['tokens']))
print(f'bench first turns ({len(pairs)})', acc(pairs), flush=True)
