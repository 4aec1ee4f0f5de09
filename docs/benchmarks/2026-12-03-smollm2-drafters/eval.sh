#!/usr/bin/env bash
# Quantize the trained SmolLM2 drafters to 8 bits (what ships) and measure them with the
# harness on held-out MT-Bench + HumanEval prompts (bf16 target, greedy, paired reps), then
# pack drafters and records into $OUT.
set -euo pipefail
M=${M:-/tmp/big/smollm2.gguf}; D=${D:-/tmp/drafters}; R=${R:-/tmp/eval}
for k in dflash eagle3 mtp; do python -m train.quantize "$D/$k" "$D/q/$k" --bits 8 --group-size 64; done
cp "$D/data/prompts.jsonl" "$D/q/prompts.jsonl"
cells=${CELLS:-"dflash_a:dflash eagle3:eagle3 mtp:mtp dflash_c:dflash"}
for cell in $cells; do
  python -m harness arch=smollm2 "arch.model=$M" arch.dtype=bfloat16 "method=${cell%%:*}" \
    "method.drafter=$D/q/${cell##*:}" bench=real_full bench.per_category=1 "out_dir=$R" ${EXTRA:-} || true
done
python -m report "$R" > "$R/report.txt" 2>&1 || true
if [ -n "${OUT:-}" ]; then
  tar -C "$D/q" -cf "$OUT/drafters.tar" .
  tar -C "$R" -czf "$OUT/records.tgz" .
  for k in dflash eagle3 mtp; do cp "$D/$k/training.json" "$OUT/$k-training-bf16.json" 2>/dev/null || true; done
fi
