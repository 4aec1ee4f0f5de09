"""`python -m report <results dir>`: an ADR-ready report from the records in a directory.

Writes report.md (setup, protocol, tables, plots), report.csv (one row per cell),
categories.csv (one row per cell and prompt category), prompts.csv (one row per prompt
and turn), profiles.csv and four PNG plots into the directory, and prints the
per-architecture tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.records import iter_records
from report.document import write
from report.tables import arch_tables


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m report <results dir>", file=sys.stderr)
        return 2
    root = Path(argv[0])
    if not root.is_dir():
        print(f"error: {root} is not a directory; pass the out_dir of a harness run (e.g. results/sweep-qwen35)",
              file=sys.stderr)
        return 2
    if not any(True for _ in iter_records(root)):
        print(f"error: no harness records under {root}; run `python -m harness out_dir={root}` first",
              file=sys.stderr)
        return 2
    md, df = write(root)
    print(arch_tables(df))
    print(f"{len(df)} cells -> {md} (+ report.csv, categories.csv, prompts.csv, profiles.csv, *.png in {root})",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
