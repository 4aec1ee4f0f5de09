#!/usr/bin/env bash
# jobs/graph_env.py once per CUDA-graph setting (each is read once per process), lines to $OUT/graph-env.jsonl.
#   bash jobs/graph-env.sh ["CACHE:OPS" ...]     (default: the grid below; "-" keeps MLX's default)
set -uo pipefail
out="${OUT:-.}/graph-env.jsonl"
settings=("$@"); [ $# -gt 0 ] || settings=("-:-" "1000:-" "1000:50" "1000:100" "-:100" "4000:200")
for s in "${settings[@]}"; do
  cache="${s%%:*}" ops="${s##*:}"
  env_args=()
  [ "$cache" != "-" ] && env_args+=("MLX_CUDA_GRAPH_CACHE_SIZE=$cache")
  [ "$ops" != "-" ] && env_args+=("MLX_MAX_OPS_PER_BUFFER=$ops")
  echo "[graph-env] cache=$cache ops=$ops" >&2
  timeout "${SETTING_S:-120}" env "${env_args[@]}" python jobs/graph_env.py --label "cache=$cache ops=$ops" --out "$out" \
    ${GRAPH_ENV_ARGS:-} || echo "[graph-env] cache=$cache ops=$ops failed or timed out" >&2
done
