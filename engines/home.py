"""Where the harness keeps what it builds once per machine (converted models, fixtures,
assembled draft models, outside engines' logs): $SPEC_HARNESS_HOME, else ~/.cache/spec-harness."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SPEC_HARNESS_HOME"


def home() -> Path:
    return Path(os.environ.get(HOME_ENV, Path.home() / ".cache" / "spec-harness"))
