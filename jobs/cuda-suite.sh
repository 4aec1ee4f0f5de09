#!/usr/bin/env bash
# `python -m pytest -m cuda` in one device call: the selected modules split over P pytest
# processes that run side by side (the tests are host-bound on tiny fixtures, and the H200 has
# 16 cores), every test selected, none deselected for time.
#
#   bash jobs/cuda-suite.sh [P]          # default P=4; logs and JUnit XML to $OUT (or /tmp/cuda-suite)
#   FILES="tests/test_gemm.py tests/test_mtp.py" bash jobs/cuda-suite.sh 2   # a subset (CPU dry run)
#
# The modules are dealt to the processes largest first (by test count), so the groups end
# near the same time. $OUT/summary.txt: each group's files, pytest's last line and exit status;
# the exit status is pytest's worst. Each process is bounded by TIMEOUT_S (default 540 s), so
# a hung group still returns its log inside one call; the logs are verbose (-v), so a group cut
# by its timeout still names every test it ran.
set -uo pipefail
cd "$(dirname "$0")/.."
P=${1:-4}
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
# deal the files to P groups, largest first (tests counted by `def test`, parametrization aside)
mapfile -t GROUPS_ < <(for f in $FILES; do echo "$(grep -c '^def test' "$f") $f"; done | sort -rn | awk -v p="$P" '
  { g = (NR - 1) % (2 * p); if (g >= p) g = 2 * p - 1 - g; files[g] = files[g] " " $2 }
  END { for (i = 0; i < p; i++) if (files[i] != "") print files[i] }')
pids=()
for i in "${!GROUPS_[@]}"; do
  # shellcheck disable=SC2086
  timeout "$TIMEOUT_S" python -m pytest -m cuda -v -p no:cacheprovider ${GROUPS_[$i]} \
    --junitxml="$OUT/group-$i.xml" > "$OUT/group-$i.log" 2>&1 &
  pids+=("$!")
done
worst=0
: > "$OUT/summary.txt"
for i in "${!pids[@]}"; do
  wait "${pids[$i]}"; rc=$?
  [ "$rc" -gt "$worst" ] && worst=$rc
  echo "group $i (exit $rc):${GROUPS_[$i]} -> $(tail -n 1 "$OUT/group-$i.log")" | tee -a "$OUT/summary.txt"
done
exit "$worst"
