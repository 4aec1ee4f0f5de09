#!/usr/bin/env bash
# Issue 50's hostile cases for python -m harness, the gate and jobs/, replayed: each case's exit code
# and the last line it printed. From the repo root: bash docs/benchmarks/2026-12-07-hostile-round-three/cases.sh
# (the llama fixture, the reference BLAS, a scratch folder under $TMPDIR; about 3 minutes on 2 cores).
set -u
cd "$(git rev-parse --show-toplevel)"
export SPEC_HARNESS_BLAS=reference HF_HUB_OFFLINE=1
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
TINY="arch=llama method=base bench=smoke bench.max_prompts=1 bench.max_new_tokens=4 bench.warmup=0 bench.reps=1 bench.profile=false"
case_() {  # case_ "what" command...
  local what=$1; shift
  local out; out=$("$@" 2>&1); local rc=$?
  printf '%s\n  exit %s: %s\n' "$what" "$rc" "$(printf '%s\n' "$out" | grep -v '^\s*$' | tail -n 1 | cut -c1-400)"
}
h() { python -m harness "$@"; }

printf '{"prompt": "Count to ten."}\n' > "$W/suite.jsonl"
h $TINY bench.suite="$W/suite.jsonl" out_dir="$W/stale" > /dev/null 2>&1
printf '{"prompt": "Count to twenty."}\n' > "$W/suite.jsonl"
case_ "1. a suite edited after its cell was recorded (re-measured, the log says why)" bash -c "python -m harness $TINY bench.suite=$W/suite.jsonl out_dir=$W/stale 2>&1 | grep -m1 'measuring it again'"
case_ "1. the CI gate into a folder of old records (always measures)" bash -c "python -m harness +gate=ci out_dir=$W/gate-stale --cfg job > /dev/null && echo 'composed; each check runs with force=true (harness/gate.py)'"
mkdir -p "$W/conf/gate"; printf '# @package _global_\ngate:\n  name: empty\n  checks: []\n' > "$W/conf/gate/empty.yaml"
case_ "1. an empty gate" h "hydra.searchpath=[file://$W/conf]" +gate=empty out_dir="$W/g1"
printf '# @package _global_\ngate:\n  name: noname\n  checks:\n    - overrides: [arch=llama]\n      max: {diverged_prompts: 0}\n' > "$W/conf/gate/noname.yaml"
case_ "3. a gate check without a name" h "hydra.searchpath=[file://$W/conf]" +gate=noname out_dir="$W/g2"
case_ "1. jobs/gate_noise.py --runs 0" python jobs/gate_noise.py --runs 0
case_ "1. jobs/cuda-suite.sh 0" bash jobs/cuda-suite.sh 0
case_ "3. SPEC_HARNESS_LOCK_DIR that does not exist yet (made)" env SPEC_HARNESS_LOCK_DIR="$W/new/locks" python -m harness $TINY out_dir="$W/l1"
: > "$W/afile"
case_ "3. SPEC_HARNESS_LOCK_DIR under a file" env SPEC_HARNESS_LOCK_DIR="$W/afile/locks" python -m harness $TINY out_dir="$W/l2"
case_ "3. SPEC_HARNESS_HOME that cannot be created" env SPEC_HARNESS_HOME="$W/afile/home" python -m harness $TINY out_dir="$W/l3"
case_ "3. a full disk (ulimit -f 2)" bash -c "ulimit -f 2; python -m harness $TINY out_dir=$W/full"
case_ "4. bench.temperature=nan" h $TINY bench.temperature=nan out_dir="$W/n1"
case_ "4. bench.temperature=inf" h $TINY bench.temperature=inf out_dir="$W/n2"
case_ "4. bench.reps=99999999999999999999" h $TINY bench.reps=99999999999999999999 out_dir="$W/n3"
case_ "4. bench.max_new_tokens=1" h $TINY bench.max_new_tokens=1 out_dir="$W/n4"
printf '{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "ok"}]}\n' > "$W/ctx.jsonl"
case_ "5. a context file that is not UTF-8" h $TINY bench.context=64 bench.context_source="$W/ctx.jsonl" out_dir="$W/u1"
printf '{"prompt": "caf\xe9"}\n' > "$W/latin1.jsonl"
case_ "5. a suite file that is not UTF-8" h $TINY bench.suite="$W/latin1.jsonl" out_dir="$W/u2"
printf '[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]\n' > "$W/ctx2.json"
case_ "6. -m bench.context=0,99999,64 (nothing runs)" h -m $TINY bench.context=0,99999,64 bench.context_source="$W/ctx2.json" out_dir="$W/s1"
ls "$W/s1" 2>/dev/null | grep -c json | sed 's/^/  records written: /'
case_ "6. -m bench.context=0,abc" h -m $TINY bench.context=0,abc out_dir="$W/s2"
case_ "9. method.command with an unclosed quote" h arch=llama method=subprocess "method.command='python \"x'" out_dir="$W/q1"
