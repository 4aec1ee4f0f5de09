"""Run records: one JSON file per cell, written atomically.

A cell is the resolved config with the axes its method ignores normalised away
(base has no block size and never rolls back), so equal cells get equal ids: a
sweep runs each distinct cell once, and a re-run skips cells already recorded.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from harness.config import knobs_of

SCHEMA_VERSION = 1


def canonical_cell(cfg) -> dict:
    """The parts of the config that decide the measurement, nothing else."""
    knobs = knobs_of(cfg.method.name)
    method = {"name": cfg.method.name, **{k: cfg.method[k] for k in knobs}}
    dispatch = {k: v for k, v in OmegaConf.to_container(cfg.dispatch).items() if v is not None}
    arch = OmegaConf.to_container(cfg.arch, resolve=True)
    if arch.get("gguf_dequantize", True):
        arch.pop("gguf_dequantize", None)  # the default keeps ids of cells recorded before the key existed
    return {
        **({"dispatch": dispatch} if dispatch else {}),  # only when set: the device defaults keep ids as they were
        "arch": arch,
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


def claim_cell(cid: str, out_dir) -> bool:
    """Within one multirun, True for the first job of a cell and False for every later one
    (jobs that differ only in an axis their method ignores), across processes and hosts:
    the claim is a file created exclusively in out_dir, named by the cell and the multirun
    (its multirun.yaml, which Hydra writes when the sweep starts). A later multirun claims
    afresh, so a resumed sweep re-runs what is missing. Outside a multirun: always True."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return True
        run = (Path(hc.sweep.dir) / "multirun.yaml").stat().st_mtime_ns
    except (ValueError, OSError):  # no Hydra context (gates compose their cells) or no sweep file
        return True
    claims = Path(out_dir) / ".claims"
    claims.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(claims / f"{cid}.{run}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def device_lock_path() -> Path:
    """One lock per device on this host: the CPU, the GPUs a CUDA process sees, or Metal."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        device = "cpu"  # launchers set CUDA_VISIBLE_DEVICES per job, but CPU cells all share the cores
    elif mx.metal.is_available():
        device = "metal"
    else:
        device = "cuda-" + (os.environ.get("CUDA_VISIBLE_DEVICES") or "all").replace(",", "_")
    return Path(tempfile.gettempdir()) / f"spec-harness-device-{device}.lock"


@contextmanager
def device_lock(shared: bool = False):
    """Hold this host's compute device for the measurement: cells launched in parallel (local
    processes, several jobs on one node) take turns on it, because two timed cells sharing a
    device make both cells' tok/s, and so every ratio, meaningless. The lock lives in this
    host's temp dir (per GPU set under CUDA_VISIBLE_DEVICES). Yields a function giving the
    seconds spent waiting. `shared=True` (allow_shared_device) skips it."""
    start = time.perf_counter()
    waited = [0.0]
    if shared:
        yield lambda: 0.0
        return
    with open(device_lock_path(), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        waited[0] = time.perf_counter() - start
        try:
            yield lambda: waited[0]
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue  # temp files, claims, launcher folders
        rec = read_record(path)
        if isinstance(rec, dict) and rec.get("schema") == SCHEMA_VERSION and "cell" in rec:
            yield path, rec
