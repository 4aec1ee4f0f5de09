#!/usr/bin/env bash
# jobs/graph_env.py once per setting of MLX's environment (each is read once per process), lines to
# $OUT/graph-env.jsonl. A setting is "-" (MLX's defaults) or comma-joined VAR=VALUE pairs:
#   bash jobs/graph-env.sh [SETTING ...]
#   e.g. bash jobs/graph-env.sh - MLX_CUDA_USE_CUDNN_SDPA=0 - MLX_CUDA_USE_CUDNN_SDPA=0
# Give each setting twice, interleaved (A B A B): a fresh machine gets faster from one process to
# the next as it compiles kernels. The default: cuDNN attention on and off, twice.
set -uo pipefail
out="${OUT:-.}/graph-env.jsonl"
settings=("$@"); [ $# -gt 0 ] || settings=(- MLX_CUDA_USE_CUDNN_SDPA=0 - MLX_CUDA_USE_CUDNN_SDPA=0)
for s in "${settings[@]}"; do
  env_args=()
  if [ "$s" != "-" ]; then
    IFS=, read -ra pairs <<< "$s"
    for p in "${pairs[@]}"; do
      case $p in
        MLX_*=*) env_args+=("$p") ;;
        *) echo "[graph-env] '$p' in setting '$s' is not MLX_NAME=VALUE" >&2; exit 2 ;;
      esac
    done
  fi
  echo "[graph-env] $s" >&2
  timeout "${SETTING_S:-120}" env "${env_args[@]}" python jobs/graph_env.py --label "$s" --out "$out" \
    ${GRAPH_ENV_ARGS:-} || echo "[graph-env] $s failed or timed out" >&2
done
