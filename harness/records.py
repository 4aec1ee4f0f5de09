"""Run records: one JSON file per cell, written atomically.

A cell (harness/config.canonical_cell) is the resolved config with the axes its method
ignores normalised away (base has no block size and never rolls back), so equal cells get
equal ids: a sweep runs each distinct cell once, and a re-run skips cells already recorded.
This module reads and writes records without the config or the engines: the report imports
it, and reads only records.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

SCHEMA_VERSION = 1


def cell_id(cell: dict) -> str:
    digest = hashlib.sha256(json.dumps(cell, sort_keys=True).encode()).hexdigest()[:10]
    m = cell["method"]
    bs = f"-bs{m['block_size']}" if m.get("block_size") else ""
    ref = f"__vs-{cell['reference']}" if cell.get("reference") not in (None, "base") else ""
    return f"{cell['arch']['name']}__{m['name']}{bs}__kv-{cell['kv']['name']}{ref}__{digest}"


def write_record(path: Path, record: dict) -> None:
    """Write `record` to `path` so that readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.stem}.*.tmp"):  # left by a run killed mid-write
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would surprise whoever shares the results
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, default=_json_default)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def multirun_id() -> int | None:
    """The running multirun's identity (the mtime of the multirun.yaml Hydra writes when the
    sweep starts), the same in every job of it, in any process or host; None outside one.
    A record carries it, so a later job of the same cell (a method that ignores the axis the
    jobs differ in) sees the cell already done in this sweep, while a resumed sweep (a new
    multirun) re-runs what is missing."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return None
        return (Path(hc.sweep.dir) / "multirun.yaml").stat().st_mtime_ns
    except (ValueError, OSError):  # no Hydra context (gates compose their cells) or no sweep file
        return None


def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_record(path: Path) -> dict | None:
    """The record at `path`, or None where there is none (or it cannot be read as one)."""
    return record_problem(path)[0]


def record_problem(path: Path) -> tuple[dict | None, str | None]:
    """(the record at `path`, None) or (None, why it is not one: unreadable, not JSON, not a record)."""
    try:
        rec = json.loads(Path(path).read_text())
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"is not valid JSON ({getattr(e, 'msg', e)}; a copy cut short, or edited by hand)"
    if not isinstance(rec, dict) or "cell" not in rec or "schema" not in rec:
        return None, "is not a harness record (no schema / cell)"
    if rec["schema"] != SCHEMA_VERSION:
        return None, f"is a record of schema {rec['schema']!r}; this harness reads schema {SCHEMA_VERSION}"
    missing = _missing_keys(rec)
    if missing:
        return None, f"is a record without {', '.join(missing)} (cut or edited by hand)"
    return rec, None


# What every record holds, and what an ok one adds: the report reads these without asking.
RECORD_KEYS = ("cell_id", "status", "config", "env")
CELL_KEYS = ("arch", "method", "bench")
SUMMARY_KEYS = ("decode_tps", "base_decode_tps", "speedup", "tau", "prompts", "diverged_prompts")


def _missing_keys(rec: dict) -> list[str]:
    missing = [k for k in RECORD_KEYS if k not in rec]
    cell = rec.get("cell") if isinstance(rec.get("cell"), dict) else {}
    missing += [f"cell.{k}" for k in CELL_KEYS if k not in cell]
    if rec.get("status") == "ok":
        summary = rec.get("summary") if isinstance(rec.get("summary"), dict) else {}
        missing += [f"summary.{k}" for k in SUMMARY_KEYS if k not in summary]
    return missing


def scan_records(root: Path) -> tuple[list[tuple[Path, dict]], list[tuple[Path, str]]]:
    """([(path, record)], [(path, why unreadable)]) for every *.json under root, hidden paths
    (temp files, launcher folders) aside: a broken record is named, never silently dropped."""
    good, bad, seen = [], [], {}
    for path in sorted(Path(root).rglob("*.json")):
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        rec, why = record_problem(path)
        if rec is None:
            bad.append((path, why))
        elif rec["cell_id"] in seen:  # results of several hosts copied together: one cell, one row
            first_path, first = seen[rec["cell_id"]]
            if rec == first:
                bad.append((path, f"is a copy of {first_path}"))
                continue
            older, newer = sorted([(first_path, first), (path, rec)], key=lambda pr: pr[1].get("started_at") or "")
            bad.append((older[0], f"measures the same cell as {newer[0]}, which is newer and is reported"))
            good = [(p, r) for p, r in good if p != first_path] + [newer]
            seen[rec["cell_id"]] = newer
        else:
            good.append((path, rec))
            seen[rec["cell_id"]] = (path, rec)
    return good, bad


def iter_records(root: Path):
    """(path, record) for every readable record under root (scan_records names the rest)."""
    yield from scan_records(root)[0]
