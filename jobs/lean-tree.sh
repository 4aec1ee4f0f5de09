#!/usr/bin/env bash
# A lean work tree for the device's stash calls: the big tracked folders moved aside and back.
#
# A device call carries the work tree and its carry folders, 64 MiB in all. The tracked tree is
# ~59 MB, so beside it a call carries one 6 MiB staging part; a stash call needs none of the
# tree, and without the docs, the fixtures and the shipped drafters (~58 MB) it is ~1.3 MB and
# a call carries eight parts (the eight paths a call may name):
#   bash jobs/lean-tree.sh aside     # before the stash calls (refuses a dirty tree or an earlier aside)
#   bash jobs/lean-tree.sh docs      # docs alone aside: a call that runs the harness on fixtures or presets
#                                    # (the tree passed 64 MiB with its docs on 2026-12-07: ~70 MB, ~35 without)
#   bash jobs/lean-tree.sh back      # before any call that runs the harness or the tests, and before a commit
#   bash jobs/lean-tree.sh status    # which state the tree is in (exit 1 while aside)
# The folders go to $LEAN_ASIDE (default: the repo's sibling .lean-aside) by rename: nothing is
# copied, and `git checkout -- .` restores them too.
set -euo pipefail
root=${LEAN_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
aside=${LEAN_ASIDE:-$root/../.lean-aside}
BIG=(docs harness/data/fixtures harness/data/drafters)

die() { echo "lean-tree: $*" >&2; exit 2; }
flat() { echo "${1//\//__}"; }  # harness/data/fixtures -> harness__data__fixtures

[ "${1:-}" = docs ] && BIG=(docs)  # `back` finds what is aside, whichever of the two moved it
case "${1:-}" in
  aside|docs)
    [ ! -e "$aside" ] || die "$aside exists: an earlier aside was not put back ('bash jobs/lean-tree.sh back')"
    [ -z "$(git -C "$root" status --porcelain)" ] || die "the work tree has changes: commit or stash them first"
    for d in "${BIG[@]}"; do [ -d "$root/$d" ] || die "$root/$d: no such folder"; done
    mkdir -p "$aside"
    for d in "${BIG[@]}"; do mv "$root/$d" "$aside/$(flat "$d")"; done
    echo "lean-tree: ${BIG[*]} moved to $aside; the tree is now $(git -C "$root" ls-files -z |
      xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes"
    ;;
  back)
    [ -d "$aside" ] || die "nothing aside ($aside is missing)"
    moved=()
    for d in "${BIG[@]}"; do
      [ -e "$aside/$(flat "$d")" ] || continue
      [ -e "$root/$d" ] && die "$root/$d exists and $aside holds it too: move one away by hand"
      mv "$aside/$(flat "$d")" "$root/$d"; moved+=("$d")
    done
    rmdir "$aside"
    echo "lean-tree: ${moved[*]} back in place"
    ;;
  status)
    if [ -d "$aside" ]; then echo "lean-tree: aside ($aside)"; exit 1; fi
    echo "lean-tree: whole"
    ;;
  *) echo "usage: $0 aside|docs|back|status" >&2; exit 2 ;;
esac
