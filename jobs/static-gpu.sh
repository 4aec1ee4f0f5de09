#!/usr/bin/env bash
# execution=static on the device, in one call after MLX is staged (source .gpu/*/activate.sh first):
# jobs/static_probe.py on SmolLM2's shape in bf16 (base three ways, verify costs, round costs), then
# tests/test_static*.py on the device (float32 losslessness where the CUDA backend runs it). Everything
# goes to $OUT: probe.jsonl, probe.log, tests.log; each step bounded (PROBE_S, TESTS_S).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/static-gpu}; mkdir -p "$OUT"
timeout "${PROBE_S:-240}" python jobs/static_probe.py --out "$OUT/probe.jsonl" ${PROBE_ARGS:-} > "$OUT/probe.log" 2>&1
echo "probe exit $?"; tail -c 3000 "$OUT/probe.log"
timeout "${TESTS_S:-240}" python -m pytest -q -p no:cacheprovider tests/test_static*.py > "$OUT/tests.log" 2>&1
echo "tests exit $?"; tail -n 15 "$OUT/tests.log"
