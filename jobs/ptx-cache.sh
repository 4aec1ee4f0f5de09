#!/usr/bin/env bash
# MLX's CUDA kernels, compiled once and carried to the next machine.
#
# MLX's CUDA backend compiles many kernels with NVRTC the first time a process uses them, and
# writes each compiled module to a cache directory that later processes on the same machine read:
# $MLX_PTX_CACHE_DIR, else $TMPDIR/mlx/<version>/ptx (mlx/backend/cuda/jit_module.cpp). A fresh
# device machine starts with none. On 2026-12-05 the first SmolLM2 eagle3 cell on a fresh H100
# spent 103 s in its warm-up, and the cells after it on the same machine spent 19-27 s.
#   bash jobs/ptx-cache.sh save OUT.tgz     # device, after the cells: the cache -> OUT.tgz (<= $PTX_LIMIT_MB)
#   bash jobs/ptx-cache.sh stage IN.tgz     # CPU: .gpu/ptx/ (IN.tgz + stash.sh), a carry folder for one call
#   bash jobs/ptx-cache.sh restore IN.tgz   # device: unpack IN.tgz where MLX looks (activate.sh does this
#                                           #   with /root/stash/ptx-cache.tgz, once per machine)
# The cubins target the device's compute capability (sm_90 for H100 and H200): a cache from
# another kind of GPU is not read for it, only recompiled beside.
set -euo pipefail
# The whole tree, every MLX version's ptx/ beneath; saved and restored as its contents, so both
# sides must agree on MLX_PTX_CACHE_DIR (the jobs leave it unset).
root="${MLX_PTX_CACHE_DIR:-${TMPDIR:-/tmp}/mlx}"
limit_mb=${PTX_LIMIT_MB:-16}  # a device call brings back files of at most 16 MiB

die() { echo "ptx-cache: $*" >&2; exit 2; }

case "${1:-}" in
  save)
    out=${2:?usage: ptx-cache.sh save OUT.tgz}
    [ -d "$root" ] && [ -n "$(ls -A "$root" 2>/dev/null)" ] || die "no compiled kernels under $root: nothing to save"
    tmp="$out.partial"
    tar -C "$root" -czf "$tmp" .
    size=$(stat -c %s "$tmp")
    if [ "$size" -gt $((limit_mb * 1024 * 1024)) ]; then
      rm -f "$tmp"; die "$root packs to $size bytes, over the $limit_mb MiB a file may be: not saved"
    fi
    mv "$tmp" "$out"
    echo "ptx-cache: $(find "$root" -type f -name '*.txt' | wc -l) compiled modules from $root -> $out ($size bytes)"
    ;;
  stage)
    in=${2:?usage: ptx-cache.sh stage IN.tgz}
    [ -f "$in" ] || die "$in: no such file"
    tar -tzf "$in" >/dev/null 2>&1 || die "$in: not a gzip tar (make it with 'ptx-cache.sh save')"
    dest="${GPU_DIR:-$(cd "$(dirname "$0")/.." && pwd)/.gpu}/ptx"  # GPU_DIR: another staging root (tests)
    rm -rf "$dest"; mkdir -p "$dest"
    cp "$in" "$dest/ptx-cache.tgz"
    cat > "$dest/stash.sh" <<'EOF'
#!/usr/bin/env bash
# Keep the compiled-kernel cache beside the other stashed parts; activate.sh unpacks it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p /root/stash && cp "$here/ptx-cache.tgz" /root/stash/
echo "[stash] ptx-cache.tgz"
EOF
    echo "ptx-cache: $dest staged: carry it in one call running 'bash .gpu/ptx/stash.sh'"
    ;;
  restore)
    in=${2:?usage: ptx-cache.sh restore IN.tgz}
    [ -f "$in" ] || die "$in: no such file"
    tar -tzf "$in" >/dev/null 2>&1 || die "$in: not a gzip tar (make it with 'ptx-cache.sh save')"
    mkdir -p "$root"
    tar -C "$root" -xzf "$in"
    echo "ptx-cache: $(find "$root" -type f -name '*.txt' | wc -l) compiled modules under $root"
    ;;
  *) die "usage: ptx-cache.sh save OUT.tgz | stage IN.tgz | restore IN.tgz" ;;
esac
