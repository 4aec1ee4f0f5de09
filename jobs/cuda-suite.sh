#!/usr/bin/env bash
# `python -m pytest -m cuda` in one device call: the selected tests split over P pytest
# processes that run side by side (the tests are host-bound on tiny fixtures, and the H200 has
# 16 cores), every test selected, none deselected for time.
#
#   bash jobs/cuda-suite.sh [P]          # default P=4; logs and JUnit XML to $OUT (or /tmp/cuda-suite)
#   FILES="tests/test_gemm.py tests/test_mtp.py" bash jobs/cuda-suite.sh 2   # a subset (CPU dry run)
#
# The tests, not the modules, are dealt to the processes in turn (test i to group i mod P): on the
# H100 on 2026-12-05 one module dealt whole (test_dflash) was still running when the other seven
# groups had ended. $OUT/tests-N.txt lists group N's test ids; $OUT/summary.txt: each group's
# test count, pytest's last line and exit status;
# the exit status is pytest's worst. Each process is bounded by TIMEOUT_S (default 540 s), so
# a hung group still returns its log inside one call; the logs are verbose (-v), so a group cut
# by its timeout still names every test it ran.
set -uo pipefail
cd "$(dirname "$0")/.."
P=${1:-4}
[[ "$P" =~ ^[1-9][0-9]*$ && "$P" -le 64 ]] || { echo "error: P=$P is not a process count: give 1-64 (bash jobs/cuda-suite.sh 4)" >&2; exit 2; }
OUT=${OUT:-/tmp/cuda-suite}; mkdir -p "$OUT"
TIMEOUT_S=${TIMEOUT_S:-540}
if [ -z "${FILES:-}" ]; then
  FILES=$(python - <<'EOF'
import sys
sys.path.insert(0, "tests")
from conftest import CUDA_MODULES
print(" ".join(f"tests/{m}.py" for m in sorted(CUDA_MODULES)))
EOF
)
fi
# collect the selected test ids once, then deal them in turn (a module's tests spread over all groups)
python -m pytest -m cuda --collect-only -q -p no:cacheprovider $FILES 2>/dev/null | grep '::' > "$OUT/selected.txt"
[ -s "$OUT/selected.txt" ] || { echo "error: no test selected (python -m pytest -m cuda --collect-only $FILES)" >&2; exit 2; }
for i in $(seq 0 $((P - 1))); do awk -v p="$P" -v i="$i" '(NR - 1) % p == i' "$OUT/selected.txt" > "$OUT/tests-$i.txt"; done
pids=()
for i in $(seq 0 $((P - 1))); do
  [ -s "$OUT/tests-$i.txt" ] || continue
  mapfile -t ids < "$OUT/tests-$i.txt"
  timeout "$TIMEOUT_S" python -m pytest -m cuda -v -p no:cacheprovider "${ids[@]}" \
    --junitxml="$OUT/group-$i.xml" > "$OUT/group-$i.log" 2>&1 &
  pids+=("$i:$!")
done
worst=0
: > "$OUT/summary.txt"
for p in "${pids[@]}"; do
  i=${p%%:*}; wait "${p#*:}"; rc=$?
  [ "$rc" -gt "$worst" ] && worst=$rc
  echo "group $i (exit $rc, $(grep -c . "$OUT/tests-$i.txt") tests) -> $(tail -n 1 "$OUT/group-$i.log")" | tee -a "$OUT/summary.txt"
done
exit "$worst"
