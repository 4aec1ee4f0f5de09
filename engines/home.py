"""Where the harness keeps what it builds once per machine (converted models, fixtures,
assembled draft models, outside engines' logs): $SPEC_HARNESS_HOME, else ~/.cache/spec-harness."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SPEC_HARNESS_HOME"


def home() -> Path:
    return Path(os.environ.get(HOME_ENV, Path.home() / ".cache" / "spec-harness"))


def checked_home() -> Path:
    """home(), made if missing and able to take a file, or ConfigError naming SPEC_HARNESS_HOME (or the
    default it stands for) and the fix; an OS error under it later names the variable too. An entry
    point calls this before anything runs, so a home that cannot be made is one line, not a traceback."""
    from harness.faults import writable_dir  # the harness's fault boundary; engines never import it at load

    setting = HOME_ENV if os.environ.get(HOME_ENV) else f"the harness's home (set {HOME_ENV})"
    return writable_dir(home(), setting, f"set {HOME_ENV} to a writable directory")
