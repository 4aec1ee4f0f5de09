#!/bin/bash
# What this folder ran, from the repo root of the tree under test (TREE, default: this checkout).
#   measure: the adapter against mlx-lm in-process, on the harness's default BLAS (MKL here)
#   cases:   the issue's cases, one cell each on the llama fixture (the reference BLAS, as the tests run)
#   blas:    the adapter against mlx-lm on the fixture, on the harness's default BLAS: as given, and with
#            the LD_PRELOAD it is given removed (a child on another BLAS than the harness's)
HERE=$(cd "$(dirname "$0")" && pwd)
cd "${TREE:-$HERE/../../..}" || exit 2
case "$1" in
measure)
  CK=$(python -c "from harness.models.resolve import resolve_model; print(resolve_model('smollm2', 'float32'))")
  python -m harness arch=smollm2 arch.dtype=float32 method=subprocess \
    "method.command='python examples/mlx_lm_adapter.py --model $CK --dtype float32'" reference=mlx_lm \
    bench=real bench.per_category=4 bench.max_new_tokens=48 bench.reps=6 bench.profile=false out_dir="${OUT:-$HERE}"
  ;;
cases)
  export SPEC_HARNESS_BLAS=reference
  CELL="arch=llama arch.dtype=float32 bench=smoke bench.max_prompts=1 bench.max_new_tokens=24 bench.reps=1 bench.profile=false"
  OUT=${OUT:-/tmp/footing-cases}
  for mode in late_done claims_drafts stops_short; do
    rm -rf "$OUT/$mode"
    python -m harness method=subprocess "method.command='python $HERE/fake_engine.py $mode'" $CELL out_dir="$OUT/$mode" \
      > "$OUT-$mode.log" 2>&1
    echo "$mode: exit $?"; grep -E "warning:|-> " "$OUT-$mode.log"
  done
  rm -rf "$OUT/forever"
  python -m harness method=server method.url=http://127.0.0.1:18431 "method.launch='python $HERE/fake_server.py 18431'" \
    method.startup_timeout_s=20 $CELL out_dir="$OUT/forever" > "$OUT-forever.log" 2>&1
  echo "forever: exit $?"; grep -E "warning:|-> " "$OUT-forever.log"
  ;;
blas)
  FX=$(python -c "from harness.models.fixtures import fixture_dir; print(fixture_dir('llama'))")
  CELL="arch=llama arch.dtype=float32 bench=smoke bench.max_prompts=1 bench.max_new_tokens=24 bench.reps=2 bench.profile=false"
  OUT=${OUT:-/tmp/footing-blas}
  for how in given stripped; do
    pre=""; [ $how = stripped ] && pre="env -u LD_PRELOAD "
    rm -rf "$OUT/$how"
    python -m harness method=subprocess reference=mlx_lm $CELL out_dir="$OUT/$how" \
      "method.command='${pre}python examples/mlx_lm_adapter.py --model $FX --dtype float32'" > "$OUT-$how.log" 2>&1
    echo "$how: exit $?"; grep -E "warning:|-> " "$OUT-$how.log"
    python -c "import json, glob, sys; r = json.load(open(glob.glob(sys.argv[1] + '/*.json')[0])); b = r['engine']['blas']
print('  env.blas:', r['env']['blas'], '| given LD_PRELOAD:', ':'.join(b['given']['preload']), '| reported:', b['reported'])" "$OUT/$how"
  done
  ;;
*)
  echo "usage: $0 measure|cases|blas" >&2; exit 2
  ;;
esac
