#!/usr/bin/env bash
# One device call (H200, MLX CUDA): train the SmolLM2-135M drafters on self-distilled data
# generated on CPU beforehand (DATA: 512 Magpie prompts, float32 target, greedy answers), then
# measure them with the harness on held-out MT-Bench + HumanEval. Every artifact is packed
# into $OUT as soon as it exists, so a call cut short still returns what was done.
set -uo pipefail
G=/tmp/big/SmolLM2-135M-Instruct.Q4_1.gguf  # the packaged file's name: the data manifest names its conversion
[ -f "$G" ] || cp /tmp/big/smollm2.gguf "$G"
D=${D:-/tmp/drafters}; R=${R:-/tmp/eval}; mkdir -p "$D" "$R"
[ -d "$D/data" ] || cp -r "${DATA:-.gpu/data}" "$D/data"
common=(arch=smollm2 "arch.model=$G" arch.dtype=float32 "data.cache_dir=$D/data" data.n_prompts=512 data.batch=64
        data.max_new_tokens=128 data.max_len=384 data.eval_rows=32 train.log_every=50 train.eval_every=200)
pack() {  # quantized drafters (what ships) and the full-precision runs' records and curves
  for k in dflash eagle3 mtp; do
    [ -f "$D/$k/model.safetensors" ] && [ ! -d "$D/q/$k" ] && python -m train.quantize "$D/$k" "$D/q/$k" --bits 8 --group-size 64
  done
  for k in dflash eagle3 mtp; do  # one file per drafter: a call returns files of 16 MiB at most
    [ -d "$D/q/$k" ] && tar -C "$D/q" -cf "$OUT/drafter-$k-q8.tar" "$k"
  done
  (cd "$D" && tar -cf "$OUT/training-records.tar" */training.json */config.json */curves.png 2>/dev/null)
}
budget=${BUDGET:-1}
python -m harness.train train=dflash "${common[@]}" "out=$D/dflash" train.steps=1500 train.batch=8 \
  train.num_layers=2 train.intermediate_size=1536 train.max_seconds=$((110 * budget)); pack
python -m harness.train train=eagle3 "${common[@]}" "out=$D/eagle3" train.steps=1500 train.batch=8 train.lr=3e-4 \
  train.intermediate_size=1536 train.draft_vocab_size=8192 train.max_seconds=$((130 * budget)); pack
python -m harness.train train=mtp "${common[@]}" "out=$D/mtp" train.steps=1500 train.batch=8 train.lr=3e-4 \
  train.max_seconds=$((60 * budget)); pack
for cell in ${CELLS:-dflash_a:dflash eagle3:eagle3 mtp:mtp}; do
  timeout ${CELL_S:-120} python -m harness arch=smollm2 "arch.model=$G" arch.dtype=bfloat16 "method=${cell%%:*}" \
    "method.drafter=$D/q/${cell##*:}" bench=real_full bench.per_category=1 "out_dir=$R" ${EXTRA:-}
  python -m report "$R" > "$R/report.txt" 2>&1
  tar -C "$R" -czf "$OUT/records.tgz" .
done
