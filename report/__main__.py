"""`python -m report <results dir>`: an ADR-ready report from the records in a directory.

Writes report.md (setup, protocol, tables, the axes section, plots), report.csv (one row per
cell), categories.csv (one row per cell and prompt category), prompts.csv (one row per prompt
and turn), profiles.csv, depth.csv (one row per cell and depth bin) and the PNG plots into the
directory, and prints the per-architecture tables.

Every *.json under the directory that is not a readable record is named on stderr and in
report.md; `--strict` makes that exit 1 (after writing the report), for CI. Exit codes: 0
written, 1 --strict found unreadable files, 2 bad input (one line), 3 the report failed (its
traceback, then one line; the previous report files stay whole).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from harness.records import scan_records
from report.document import write
from report.tables import arch_tables

USAGE = "usage: python -m report [--strict] <results dir>"


def main(argv: list[str]) -> int:
    strict = "--strict" in argv
    args = [a for a in argv if a != "--strict"]
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if len(args) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    root = Path(args[0])
    if not root.is_dir():
        print(f"error: {root} is not a directory; pass the out_dir of a harness run (e.g. results/sweep-qwen35)",
              file=sys.stderr)
        return 2
    good, unread = scan_records(root)
    for path, why in unread:
        print(f"warning: {path} {why}: left out of the report", file=sys.stderr)
    if not good:
        print(f"error: no harness records under {root}; run `python -m harness out_dir={root}` first",
              file=sys.stderr)
        return 2
    try:
        md, df = write(root)
    except OSError as e:
        print(f"error: cannot write the report into {root} ({e.strerror or e}): pass a directory you can write to",
              file=sys.stderr)
        return 2
    except Exception:  # noqa: BLE001 -- the traceback for whoever debugs it, then the one line
        traceback.print_exc()
        print(f"error: the report over {root} failed (traceback above); its previous report files are left whole",
              file=sys.stderr)
        return 3
    print(arch_tables(df))
    print(f"{len(df)} cells -> {md} (+ report.csv, categories.csv, prompts.csv, profiles.csv, depth.csv, *.png "
          f"in {root})", file=sys.stderr)
    if unread and strict:
        print(f"error: {len(unread)} file(s) under {root} could not be read as records (--strict)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
