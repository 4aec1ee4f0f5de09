#!/usr/bin/env bash
# Device calls (H200, MLX CUDA) for the SmolLM2-135M drafters, on self-distilled data generated
# on CPU beforehand (DATA, copied to $D/data; the settings below must match its manifest):
#   JOBS="dflash eagle3" bash device.sh        # call 1: train (each job bounded by max_seconds)
#   JOBS="mtp draft_model" bash device.sh      # call 2
#   JOBS= CELLS="dflash_a:dflash ..." bash device.sh   # call 3: measure
# Every artifact is packed into $OUT as soon as it exists (one file per drafter: a call returns
# files of 16 MiB at most), so a call cut short still returns what was done. Rerunning a job
# resumes it from its last checkpoint while the machine is warm.
set -uo pipefail
G=/tmp/big/SmolLM2-135M-Instruct.Q4_1.gguf  # the packaged file's name: the data manifest names its conversion
[ -f "$G" ] || cp /tmp/big/smollm2.gguf "$G"
D=${D:-/tmp/drafters}; R=${R:-/tmp/eval}; mkdir -p "$D" "$R"
[ -d "$D/data" ] || cp -r "${DATA:-.gpu/data2}" "$D/data"
common=(arch=smollm2 "arch.model=$G" arch.dtype=float32 "data.cache_dir=$D/data" data.n_prompts=${N_PROMPTS:-2048}
        data.batch=64 data.max_new_tokens=${MAX_NEW:-160} data.max_len=${MAX_LEN:-448} data.eval_rows=64
        train.log_every=100 train.eval_every=250)
s=${BUDGET:-1}  # scales every job's max_seconds
declare -A args=(
  [dflash]="train.steps=4000 train.batch=8 train.num_layers=2 train.intermediate_size=1536 train.max_seconds=$((240 * s))"
  [eagle3]="train.steps=4000 train.batch=8 train.lr=3e-4 train.intermediate_size=1536 train.draft_vocab_size=8192 train.max_seconds=$((240 * s))"
  [mtp]="train.steps=3000 train.batch=8 train.lr=3e-4 train.max_seconds=$((120 * s))"
  [draft_model]="train.steps=3000 train.batch=8 train.lr=2e-4 train.num_layers=6 train.max_seconds=$((180 * s))"
)
pack() {  # quantized drafters (what ships) and the full-precision runs' records and curves
  for k in dflash eagle3 mtp draft_model; do
    [ -f "$D/$k/model.safetensors" ] && [ ! -d "$D/q/$k" ] && python -m train.quantize "$D/$k" "$D/q/$k" --bits 8 --group-size 64
    [ -d "$D/q/$k" ] && tar -C "$D/q" -cf "$OUT/drafter-$k-q8.tar" "$k"
  done
  (cd "$D" && tar -cf "$OUT/training-records.tar" */training.json */config.json */curves.png 2>/dev/null)
}
for k in ${JOBS-dflash eagle3 mtp draft_model}; do
  python -m harness.train "train=$k" "${common[@]}" "out=$D/$k" ${args[$k]} 2>&1 | grep -v "step/s" ; pack
done
for cell in ${CELLS:-}; do  # method:drafter kind
  timeout ${CELL_S:-150} python -m harness arch=smollm2 "arch.model=$G" arch.dtype=bfloat16 "method=${cell%%:*}" \
    "method.drafter=$D/q/${cell##*:}" bench=real_full bench.per_category=1 "out_dir=$R" ${EXTRA:-}
  python -m report "$R" > "$R/report.txt" 2>&1
  tar -C "$R" -czf "$OUT/records.tgz" .
done
