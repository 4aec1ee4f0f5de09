"""`python -m report <results dir>`: tables from the records under a results directory.

Writes <dir>/report.csv (one row per cell) and <dir>/prompts.csv (one row per
prompt) and prints one markdown table per architecture.
"""

from __future__ import annotations

import sys
from pathlib import Path

from report.frames import cells, prompts
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
    df = cells(root)
    if df.empty:
        print(f"error: no harness records under {root}; run `python -m harness` with out_dir={root} first",
              file=sys.stderr)
        return 2
    df.to_csv(root / "report.csv", index=False)
    prompts(root).to_csv(root / "prompts.csv", index=False)
    print(arch_tables(df))
    print(f"{len(df)} cells -> {root / 'report.csv'}, {root / 'prompts.csv'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
