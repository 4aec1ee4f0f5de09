"""A finished report moves into its directory all or none.

Every output is written into a hidden staging folder inside the results directory (hidden paths
are no records to scan_records); only when all are ready do they replace the previous report,
after a check that every destination can be replaced. A move that still fails puts every
previous file back, so the directory holds the old report or the new one, never a mix.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from harness.errors import ConfigError
from harness.faults import Fault

# Every file a report may write: one the new report does not write (depth.csv where no cell ran
# rounds) is removed with the previous report, so no stale file stands beside the new report.md.
OUTPUTS = ("report.md", "report.csv", "categories.csv", "prompts.csv", "profiles.csv", "depth.csv",
           "speedup_vs_block.png", "tau_histograms.png", "profile.png", "predicted_vs_measured.png",
           "tau_by_depth.png", "speedup_vs_context.png", "speedup_vs_temperature.png")
PREFIX = ".report-"


@contextmanager
def staging(root: Path):
    """A fresh hidden folder inside `root` to write the report into, removed on leaving (the
    files published from it are gone from it by then). ConfigError where `root` takes no folder:
    the directory the user passed cannot hold a report."""
    try:
        folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    except OSError as e:
        raise ConfigError(f"cannot write the report into {root}: {e.strerror or e}; make it writable for this user, "
                          "or copy its records into a directory you can write and report there") from None
    try:
        yield folder
    finally:
        if not (folder / KEPT).exists():  # a failed roll-back keeps the previous files there (publish says so)
            shutil.rmtree(folder, ignore_errors=True)


KEPT = ".previous"  # inside the staging folder: the previous report's files while the new ones move in


def publish(folder: Path, root: Path) -> list[str]:
    """Move every file of `folder` into `root`, replacing the previous report, and remove the
    previous report's files the new one does not write; all or none. Refuses (Fault, nothing
    touched) where a destination cannot be replaced. Returns the names published."""
    names = sorted(f.name for f in folder.iterdir() if f.is_file())
    stale = [n for n in OUTPUTS if n not in names and _is_file(root / n)]
    _check_replaceable(root, names)
    previous = folder / KEPT
    previous.mkdir()
    kept, placed = [], []  # previous files moved aside; new files moved in
    try:
        for name in names + stale:
            if os.path.lexists(root / name):
                os.replace(root / name, previous / name)
                kept.append(name)
            if name in names:
                os.replace(folder / name, root / name)
                placed.append(name)
    except BaseException:
        _roll_back(root, previous, placed, kept)
        raise
    shutil.rmtree(previous, ignore_errors=True)
    return names


def meant_for(path, root: Path):
    """The file in `root` that a path inside one of its staging folders stands for (so an error
    names where the file was going, not a folder that is gone by the time it is read); other
    paths as they are."""
    if path is None or PREFIX not in str(path):
        return path
    return str(root / Path(path).name)


def _is_file(path: Path) -> bool:
    return path.is_symlink() or path.is_file()


def _check_replaceable(root: Path, names: list[str]) -> None:
    # A folder where a file goes cannot be replaced by a rename: refuse before anything moves.
    for name in names:
        dest = root / name
        if dest.is_dir() and not dest.is_symlink():
            raise Fault(f"cannot write the report: {dest} is a folder where the report writes a file; move it "
                        "away, then rerun (nothing was replaced: the previous report files are as they were)")


def _roll_back(root: Path, previous: Path, placed: list[str], kept: list[str]) -> None:
    # Undo `publish`: the new files out, the previous ones back.
    try:
        for name in placed:
            os.unlink(root / name)
        for name in kept:
            os.replace(previous / name, root / name)
    except OSError as e:
        raise Fault(f"the report could not be moved into {root} nor the previous one put back ({e.strerror or e} "
                    f"on {e.filename}); the previous report files are in {previous}: move them back by hand") from e
    shutil.rmtree(previous, ignore_errors=True)
