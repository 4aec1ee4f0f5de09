"""Run records: one JSON file per cell, written atomically.

A cell is the resolved config with the axes its method ignores normalised away
(base has no block size and never rolls back), so equal cells get equal ids: a
sweep runs each distinct cell once, and a re-run skips cells already recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from harness.config import knobs_of

SCHEMA_VERSION = 1


def canonical_cell(cfg) -> dict:
    """The parts of the config that decide the measurement, nothing else."""
    knobs = knobs_of(cfg.method.name)
    method = {"name": cfg.method.name, **{k: cfg.method[k] for k in knobs}}
    return {
        "arch": OmegaConf.to_container(cfg.arch, resolve=True),
        "method": method,
        "kv": OmegaConf.to_container(cfg.kv, resolve=True) if cfg.kv.name in ("q8", "q4") else {"name": cfg.kv.name},
        "bench": OmegaConf.to_container(cfg.bench, resolve=True),
        "rollback": cfg.rollback if method["name"] != "base" else None,
        "reference": cfg.reference if method["name"] != cfg.reference else None,
    }


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


def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_record(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def iter_records(root: Path):
    """(path, record) for every record under root; temp files and non-records skipped."""
    for path in sorted(Path(root).rglob("*.json")):
        if path.name.startswith("."):
            continue
        rec = read_record(path)
        if isinstance(rec, dict) and rec.get("schema") == SCHEMA_VERSION and "cell" in rec:
            yield path, rec
