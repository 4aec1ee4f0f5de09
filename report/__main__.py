"""`python -m report <results dir>`: an ADR-ready report from the records in a directory.

Writes report.md (setup, protocol, tables, the axes section, plots), report.csv (one row per
cell), categories.csv (one row per cell and prompt category), prompts.csv (one row per prompt
and turn), profiles.csv, depth.csv (one row per cell and depth bin) and the PNG plots into the
directory, and prints the per-architecture tables. The files are staged in a hidden folder and
moved in only when all are ready: on any failure the previous report stays whole.

Every *.json under the directory that is not a readable record (not a regular file, not JSON,
not a record, a record with a field of the wrong type or values the report cannot use) is named
on stderr and in report.md and left out; `--strict` makes that exit 1 (after writing the
report), for CI. Exit codes (harness/faults.py): 0 written, 1 --strict found files that are not
records, 2 bad input (one line: no directory, no records, a directory that cannot take the
report), 3 the report failed (one line, after a traceback where the code itself failed; the
previous report files stay whole), 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path

from harness.errors import ConfigError
from harness.faults import Fault, guarded, name_path, os_error_line
from harness.records import scan_records
from report.document import Written, write
from report.publish import meant_for
from report.frames import build_frames
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
    return guarded(lambda: report(root, strict), app=f"the report over {root}",
                   interrupted="the previous report files are left whole")


def report(root: Path, strict: bool) -> int:
    """Report the records under `root` (module docstring); the exit code, or raises for guarded."""
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory; pass the out_dir of a harness run (e.g. results/sweep-qwen35)")
    name_path(root, "the results directory given to python -m report")
    try:
        written, left_out = _write(root)
    except OSError as e:  # a full disk, a folder gone mid-way: its path, and that nothing was half-replaced
        e.filename = meant_for(e.filename, root)
        raise Fault(f"{os_error_line(e, 'cannot write the report')}; the previous report files are left whole") from None
    except MemoryError:
        raise Fault(f"the report over {root} ran out of memory; report fewer records at once (a subfolder), or on a "
                    "machine with more memory; the previous report files are left whole") from None
    print(arch_tables(written.cells))
    print(f"{len(written.cells)} cells -> {written.md} (+ report.csv, categories.csv, prompts.csv, profiles.csv, "
          f"depth.csv, *.png in {root})", file=sys.stderr)
    if left_out and strict:
        print(f"error: {left_out} file(s) under {root} could not be read as records (--strict)", file=sys.stderr)
        return 1
    return 0


def _write(root: Path) -> tuple[Written, int]:
    # The report written, and how many files it left out (each named on stderr before anything is written).
    good, unread = scan_records(root)
    frames = build_frames(good)
    _warn(unread + frames.damaged)
    if not frames.records:
        usable = " that the report can use" if good else ""
        raise ConfigError(f"no harness records under {root}{usable}; run `python -m harness out_dir={root}` first")
    return write(root, (good, unread), frames), len(unread) + len(frames.damaged)


def _warn(unread: list) -> None:
    for path, why in unread:
        print(f"warning: {path} {why}: left out of the report", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
