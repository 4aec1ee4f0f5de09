"""Writing under `out` and the data cache so that a full disk, a size limit (ulimit -f) or a folder
that went away is an OSError naming the file: harness/faults.py then turns it into one line naming
the setting that chose the folder and what can cure it. Python's write() and MLX's writer name no
file when they fail, so every write here goes through `writing`."""

from __future__ import annotations

import errno
import os
import resource
import shutil
from contextlib import contextmanager
from pathlib import Path

FEW_BYTES_FREE = 64 << 20  # below this, a failed write is taken for a full disk


@contextmanager
def writing(path: Path):
    """Whatever fails while `path` is written leaves as an OSError naming it."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise
    except RuntimeError as e:  # MLX's writer: "[write] Unable to write N bytes to file."
        if "write" not in str(e).lower() and "open" not in str(e).lower():
            raise
        raise OSError(_likely_errno(Path(path)), f"{e}".strip(), str(path)) from e


def _likely_errno(path: Path) -> int:
    """What MLX's writer ran into, which it does not say: a file size limit that `path` (or a file in
    it) reached, a disk nearly full, or else an I/O error."""
    limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    files = [path] if path.is_file() else [p for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    if limit != resource.RLIM_INFINITY and any(f.stat().st_size >= limit for f in files):
        return errno.EFBIG
    folder = next((p for p in (path, *path.parents) if p.is_dir()), Path("/"))
    return errno.ENOSPC if shutil.disk_usage(folder).free < FEW_BYTES_FREE else errno.EIO


def write_text_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole or is left as it was (a temp file beside it, renamed; removed on failure)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with writing(tmp):
            tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_tensors(path: Path, arrays: dict, metadata: dict | None = None) -> None:
    """mx.save_safetensors through a Python file, so a failed write is an OSError naming `path`."""
    import mlx.core as mx

    with writing(path), open(path, "wb") as f:
        mx.save_safetensors(f, arrays, metadata=metadata)
