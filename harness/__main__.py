"""`python -m harness [overrides]`: run one cell, or a sweep with +sweep=<name>.

Overrides are checked against the config groups and the schema before Hydra runs,
so a typo gets one line naming the problem and the valid choices (exit 2).
"""

from __future__ import annotations

from harness import blas

blas.select()  # before anything imports mlx: a BLAS serves libmlx only if it is in the global scope first

import dataclasses  # noqa: E402
import sys  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from harness.config import GROUPS, NESTED, OPTION_GROUPS, Config, ConfigError, conf_dir, group_options, register_configs


def check_overrides(args: list[str]) -> None:
    """Raise ConfigError for an unknown group option or key among command-line overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        overrides = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
    except Exception:  # noqa: BLE001 -- malformed syntax: Hydra's own message is the useful one
        return
    top = {f.name for f in dataclasses.fields(Config)}
    sections = {**GROUPS, **NESTED}  # dataclasses whose fields a dotted key may name
    extra = _search_dirs(overrides)
    for o in overrides:
        key = o.key_or_group
        if key.startswith("hydra") or o.is_delete() or key.startswith("gate."):
            continue
        if key in GROUPS or key in OPTION_GROUPS:
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.value()]
            options = sorted(set(group_options(key)) | {p.stem for d in extra for p in (d / key).glob("*.yaml")})
            for v in values:
                if str(v) not in options:
                    raise ConfigError(f"unknown {key} {v!r}; available: {', '.join(options)} "
                                      f"(files in {conf_dir() / key})")
        elif "." in key and key.split(".", 1)[0] in sections:
            group, field = key.split(".", 1)
            valid = [f.name for f in dataclasses.fields(sections[group])]
            if field not in valid:
                raise ConfigError(f"unknown key {key!r}; {group} has: {', '.join(valid)}")
        elif key not in top:
            raise ConfigError(f"unknown key {key!r}; top-level keys: {', '.join(sorted(top))}, "
                              f"groups: {', '.join([*GROUPS, *OPTION_GROUPS])}")


def _search_dirs(overrides) -> list:
    # Config dirs added with hydra.searchpath=[file://...] also hold group options.
    from pathlib import Path

    for o in overrides:
        if o.key_or_group == "hydra.searchpath":
            return [Path(str(p)[len("file://"):]) for p in o.value() if str(p).startswith("file://")]
    return []


@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    blas.select()  # once more in a launcher's worker process, which never ran this module's top
    from harness.gate import run_gate
    from harness.run import run_cell

    try:
        if cfg.gate is not None:
            sys.exit(run_gate(cfg))
        run_cell(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    try:
        check_overrides(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    register_configs()
    _hydra_main()


if __name__ == "__main__":
    main()
