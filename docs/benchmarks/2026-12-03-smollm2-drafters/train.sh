#!/usr/bin/env bash
# Train the SmolLM2-135M drafters on the H200 (MLX CUDA): self-distilled data (Magpie
# instructions + the target's greedy answers), then DFlash, EAGLE-3 and MTP. Rerunning resumes
# each job from its last checkpoint; train.max_seconds bounds each run's training time so
# one 10-minute device call fits. M: the packaged GGUF (joined by the staging's activate).
set -euo pipefail
M=${M:-/tmp/big/smollm2.gguf}; D=${D:-/tmp/drafters}
common=(arch=smollm2 "arch.model=$M" arch.dtype=bfloat16 "data.cache_dir=$D/data" data.n_prompts=1536
        data.batch=128 data.max_new_tokens=256 data.max_len=512 data.eval_rows=64 train.log_every=50
        train.eval_every=250)
budget=${BUDGET:-1}  # scales every job's max_seconds
python -m harness.train train=dflash "${common[@]}" "out=$D/dflash" train.steps=1500 train.batch=4 \
  train.intermediate_size=768 train.max_seconds=$((120 * budget))
python -m harness.train train=eagle3 "${common[@]}" "out=$D/eagle3" train.steps=1200 train.batch=8 train.lr=3e-4 \
  train.intermediate_size=768 train.draft_vocab_size=4096 train.max_seconds=$((150 * budget))
python -m harness.train train=mtp "${common[@]}" "out=$D/mtp" train.steps=1000 train.batch=8 train.lr=3e-4 \
  train.max_seconds=$((80 * budget))
