#!/usr/bin/env bash
# Issue 52's GPU curves, one shape per bounded device call (after `source .gpu/c/activate.sh`):
#   bash jobs/scale-gpu.sh ARCH [COUNTS] [OVERRIDES...]
# builds ARCH's preset and drafters on first use (harness/models/scale.py), runs +sweep=cost-curves-scale
# for that ARCH alone at the forced counts COUNTS (default 0,1,2,4: tau 1, 2, 3, 5), bounded by SWEEP_S
# seconds (default 470), then packs whatever finished (records with their report, the logs) into $OUT/ARCH.tgz
# ($OUT/ARCH-TAG.tgz with TAG set, for a second run of one shape, e.g. TAG=chain ... method=eagle3 method.top_k=1).
# The check before a device call, on the CPU with tiny settings (a 4-layer random Llama):
#   OUT=/tmp/scale-check bash jobs/scale-gpu.sh llama 1 arch.model=scale:llama-tiny arch.dtype=float32 \
#     bench.max_prompts=1 bench.reps=1
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 ARCH [COUNTS] [OVERRIDES...]  (e.g. $0 scale_llama_8b 0,1,2,4)" >&2; exit 2; }
arch=$1; counts=${2:-0,1,2,4}; shift; [ $# -ge 1 ] && shift
[[ "$counts" =~ ^[0-9](,[0-9])*$ ]] || { echo "error: COUNTS=$counts: give forced counts like 0,1,2,4" >&2; exit 2; }
OUT=${OUT:-/tmp/scale-gpu}; mkdir -p "$OUT"
work=$(mktemp -d)
start=$(date +%s)
timeout "${SWEEP_S:-470}" python -m harness +sweep=cost-curves-scale "arch=$arch" "method.force.accepted=$counts" \
  "bench.max_new_tokens=${TOKENS:-48}" "out_dir=$work/records" "hydra.sweep.dir=$work/hydra" "$@" > "$work/sweep.log" 2>&1
rc=$?
echo "sweep exit $rc after $(( $(date +%s) - start )) s"
python -m report "$work/records" > "$work/report.log" 2>&1 || echo "report exit $? (report.log)"
nvidia-smi --query-gpu=name,memory.used --format=csv > "$work/gpu.txt" 2>/dev/null || true
tar czf "$OUT/$arch${TAG:+-$TAG}.tgz" -C "$work" records sweep.log report.log gpu.txt 2>/dev/null
grep -E "^\[|speedup|error" "$work/sweep.log" | tail -n 25
exit "$rc"
