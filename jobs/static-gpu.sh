#!/usr/bin/env bash
# execution=static on the device, in calls after MLX is staged (source .gpu/*/activate.sh first):
#   bash jobs/static-gpu.sh probe   # jobs/static_probe.py, SmolLM2's shape in bf16 (random weights): base three
#                                   # ways, compiled verifies against eager ones -> $OUT/probe.jsonl, probe.log
#   bash jobs/static-gpu.sh cells   # the SmolLM2 cells of +sweep=smollm2-static on the packaged GGUF (bf16,
#                                   # bench=real_full): each method static, paired with itself eager and with
#                                   # mlx-lm's generate_step -> $OUT/records.tgz (jobs/smollm2-drafters.sh measure)
#   bash jobs/static-gpu.sh tests   # tests/test_static*.py on the device -> $OUT/tests.log
# Steps run in the order given (default: probe tests); each is bounded (PROBE_S, CELL_S, TESTS_S) and a
# failed step does not stop the next. CELLS picks the methods (default: base eagle3 mtp dflash_a ngram
# draft_model); TINY=1 runs the cells with tiny settings on the CPU (the check before a device call).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/static-gpu}; mkdir -p "$OUT"
export OUT
status=0

probe() {
  timeout "${PROBE_S:-240}" python jobs/static_probe.py --out "$OUT/probe.jsonl" ${PROBE_ARGS:-} > "$OUT/probe.log" 2>&1
  local rc=$?; echo "probe exit $rc"; tail -c 3000 "$OUT/probe.log"; return $rc
}

cells() {  # the reference is the same method eager (an interpolation: one EXTRA for every cell)
  CELLS=${CELLS:-base eagle3 mtp dflash_a ngram draft_model} \
    EXTRA="execution=static reference=\${method.name}:eager also_against=mlx_lm ${EXTRA:-}" \
    bash jobs/smollm2-drafters.sh measure
}

tests() {
  timeout "${TESTS_S:-240}" python -m pytest -q -p no:cacheprovider tests/test_static*.py > "$OUT/tests.log" 2>&1
  local rc=$?; echo "tests exit $rc"; tail -n 15 "$OUT/tests.log"; return $rc
}

for step in ${*:-probe tests}; do
  case $step in
    probe|cells|tests) $step || status=1 ;;
    *) echo "usage: $0 [probe|cells|tests ...]" >&2; exit 2 ;;
  esac
done
exit "$status"
