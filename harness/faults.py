"""The fault boundary every entry point runs inside: whatever reaches the top of `python -m
harness`, `python -m train`, `python -m report` or a job under jobs/ leaves as one `error:`
line and an exit code, never as a bare traceback with exit 1 (1 is a gate bound that fell short).

    2    bad input (ConfigError and its kin): the line names the setting and the fix
    3    the machine refused what a valid run needed (an OSError: a full disk, a folder that
         vanished or became a file, a permission), or a failure of the code itself (its traceback
         first, then the line)
    130  interrupted

An OSError's line names the path, what the OS said, the setting that chose the path (an entry
point says which setting chose which folder with `name_path`) and a fix that can work: a full
disk is not cured by rerunning.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from pathlib import Path
from typing import Callable

from harness.errors import ConfigError

EXIT = {"ok": 0, "gate": 1, "bad input": 2, "failed": 3, "interrupted": 130}

_SETTINGS: dict[str, str] = {}  # an absolute path -> the setting or variable that chose it


def name_path(path, setting: str) -> None:
    """Say which setting chose `path`: an OS error on it, or on anything under it, names it."""
    _SETTINGS[_absolute(path)] = setting


def setting_of(path) -> str | None:
    """The setting that chose `path` or the nearest folder above it, or None."""
    if path is None:
        return None
    p = _absolute(path)
    best = max((k for k in _SETTINGS if p == k or p.startswith(k.rstrip("/") + "/")), key=len, default=None)
    return _SETTINGS.get(best) if best else None


def _absolute(path) -> str:
    return os.path.abspath(os.path.expanduser(os.fsdecode(path)))


# What can cure each failure: the advice that follows the OS's words.
_FIXES = {
    errno.ENOSPC: "free space on that disk, or point the setting elsewhere, then rerun",
    errno.EDQUOT: "free space under your quota, or point the setting elsewhere, then rerun",
    errno.EFBIG: "the file outgrew a size limit (ulimit -f): lift the limit or point the setting elsewhere",
    errno.EACCES: "make it writable for this user, or point the setting elsewhere",
    errno.EPERM: "make it writable for this user, or point the setting elsewhere",
    errno.EROFS: "the file system is read-only: point the setting at a writable one",
    errno.ENOTDIR: "a file stands where a folder is needed: move it away, or point the setting elsewhere",
    errno.EISDIR: "a folder stands where a file is needed: move it away, or point the setting elsewhere",
    errno.ENOENT: "it is not there (a typo, or removed while running?): check the path, or point the setting elsewhere",
    errno.EEXIST: "something already stands there: move it away, or point the setting elsewhere",
}


def os_error_line(e: OSError, doing: str = "", path=None) -> str:
    """One line for an OSError: what was being done, the path, the OS's words, the setting, the fix.
    `path`: what was being written where the error names no file (a write() that hit a full disk)."""
    setting = setting_of(e.filename or path)
    path = e.filename
    why = e.strerror or str(e) or type(e).__name__
    fix = _FIXES.get(e.errno, "check the path and the disk, then rerun")
    if setting is None:
        fix = fix.replace(", or point the setting elsewhere", "").replace("point the setting elsewhere", "use another")
    where = f"{path}: " if path else ""
    chosen = f" ({setting})" if setting else ""
    return f"{doing + ': ' if doing else ''}{where}{why}{chosen}; {fix}"


class Fault(RuntimeError):
    """The machine refused what a valid run needed; the message is the whole line (path, setting,
    fix, and where anything already measured was kept). Exit 3."""


def guarded(run: Callable[[], int | None], app: str, interrupted: str = "") -> int:
    """run()'s exit code, or the code and one `error:` line for what escaped it (module docstring).
    `app` names the command in the line for an unexpected failure; `interrupted` says what an
    interrupt leaves behind."""
    try:
        return run() or 0
    except SystemExit as e:  # an exit code chosen inside (Hydra's task function exits this way)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else _say(str(e.code), 2))
    except BaseException as e:  # noqa: BLE001 -- the boundary itself
        return exit_for(e, app, interrupted)


def exit_for(e: BaseException, app: str, interrupted: str = "") -> int:
    """Say what `e` means in one `error:` line (a traceback first for a failure of the code itself)
    and return its exit code (module docstring)."""
    if isinstance(e, ConfigError):
        return _say(str(e), EXIT["bad input"])
    if isinstance(e, KeyboardInterrupt):
        return _say(f"interrupted; {interrupted}" if interrupted else "interrupted", EXIT["interrupted"])
    if isinstance(e, Fault):
        return _say(str(e), EXIT["failed"])
    if isinstance(e, OSError):
        return _say(os_error_line(e), EXIT["failed"])
    if isinstance(e, MemoryError):
        return _say(f"{app} ran out of memory; lower the sizes that set it (tokens, context, batch, model)",
                    EXIT["failed"])
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else EXIT["failed"]
    traceback.print_exception(e)
    return _say(f"{app} failed: {type(e).__name__}: {_first_line(e)} (traceback above)", EXIT["failed"])


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _say(line: str, code: int) -> int:
    try:
        print(f"error: {line}", file=sys.stderr, flush=True)
    except OSError:  # stderr itself is gone (a closed pipe): the code still says it
        pass
    return code


def writable_dir(path, setting: str, example: str) -> Path:
    """`path` made if missing and able to take a file, named as chosen by `setting`; else ConfigError
    naming the setting and `example` as a fix (what an entry point checks before anything runs)."""
    import tempfile

    p = Path(os.path.expanduser(os.fsdecode(path)))
    try:
        p.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=p).close()
    except OSError as e:
        raise ConfigError(f"{setting}={path} cannot be used: {e.strerror or e} ({e.filename or p}); "
                          f"{example}") from None
    name_path(p, setting)
    return p


def checked_home() -> Path:
    """The harness's home (engines/home.py), made if missing and able to take a file, or ConfigError
    naming SPEC_HARNESS_HOME (or the default it stands for) and the fix; an OS error under it later
    names the variable too. Entry points call this before anything runs."""
    from engines.home import HOME_ENV, home

    setting = HOME_ENV if os.environ.get(HOME_ENV) else f"the harness's home (set {HOME_ENV})"
    return writable_dir(home(), setting, f"set {HOME_ENV} to a writable directory")
