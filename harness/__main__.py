"""`python -m harness [overrides]`: run one cell, or a sweep with +sweep=<name>.

Overrides are checked against the config groups and the schema before Hydra runs,
and the config is composed once (types, grammar, out_dir) before any job starts, so a typo
or an unusable out_dir gets one line naming the problem and the fix (exit 2) instead of
Hydra's traceback. Exit codes: harness/run.py EXIT_CODES (docs/exit-codes.md).
"""

from __future__ import annotations

from harness import blas

blas.select()  # before anything imports mlx: a BLAS serves libmlx only if it is in the global scope first

import dataclasses  # noqa: E402
import sys  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from harness.config import (GROUPS, MADE_BY_RUN, NESTED, OPTION_GROUPS, Config, check_out_dir, conf_dir, group_options,
                            register_configs)
from harness.errors import ConfigError  # noqa: E402
from harness.flags import ONLY_ONE, compose_first_job, parse_overrides  # noqa: E402


def check_overrides(overrides: list) -> None:
    """Raise ConfigError for an unknown group option or key among parsed command-line overrides."""
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


def preflight(args: list[str]) -> None:
    """Compose the config as the first job would (a sweep's first value per axis) and check
    out_dir can be written: ConfigError with Hydra's first line and the key it names."""
    cfg = compose_first_job("config", args)
    dirs = {"out_dir": str(cfg.out_dir)}
    for key in ("run", "sweep"):  # Hydra makes these before any job (both default to out_dir)
        try:
            dirs[f"hydra.{key}.dir"] = str(cfg.hydra[key].dir)
        except Exception:  # noqa: BLE001 -- a dir built from resolvers only a running app has: Hydra checks it
            pass
    for key, value in dirs.items():
        if key == "out_dir" or value != dirs["out_dir"]:
            check_out_dir(value, key)


@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    blas.select()  # once more in a launcher's worker process, which never ran this module's top
    # Only now: harness.run (and the gate, through it) loads MLX, which must come after blas.select().
    from harness.gate import run_gate
    from harness.run import OUTCOMES, CellAborted, exit_code, run_cell

    try:
        if cfg.gate is not None:
            sys.exit(run_gate(cfg))
        run_cell(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        _drop_if_empty(cfg.out_dir)
        sys.exit(2)
    except CellAborted as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.code)
    mode = _job_mode()
    if mode == "single":
        sys.exit(exit_code(OUTCOMES, sweep=False))
    if mode == "worker" and OUTCOMES and OUTCOMES[-1]["status"] == "error":
        # A job in its own process: failing it is how its launcher learns; the others run on.
        raise RuntimeError(f"cell {OUTCOMES[-1]['cell']}: error: {OUTCOMES[-1]['reason']}")


def _drop_if_empty(out_dir: str) -> None:
    """Remove the folders Hydra made for a run that stopped on bad input, as long as they are empty."""
    from pathlib import Path

    for p in MADE_BY_RUN or [Path(out_dir).expanduser()]:
        try:
            p.rmdir()
        except OSError:
            return  # not empty (other cells' records), or not there


def _job_mode() -> str:
    """single (one cell), sweep (a multirun whose jobs run in this process) or worker (a job of a
    multirun launched in its own process: submitit, Ray)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return "single"
    return "sweep" if hc.launcher._target_.split(".")[-1] == "BasicLauncher" else "worker"


def main() -> None:
    from harness.run import OUTCOMES, exit_code, outcome_summary  # loads MLX: kept off this module's import

    try:
        overrides = parse_overrides(sys.argv[1:])
        check_overrides(overrides)
        register_configs()
        preflight(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        _hydra_main()
    except KeyboardInterrupt:
        print("error: interrupted; the records of cells that finished are kept, the cell that was running wrote "
              "nothing (run the same command again: finished cells are skipped)", file=sys.stderr)
        sys.exit(130)
    except ValueError as e:  # Hydra's refusal of flags that exclude each other (-m with --cfg): one line
        if not str(e).startswith(ONLY_ONE):
            raise
        print(f"error: {e} (Hydra's rule; drop -m to see one job's config with --cfg)",
              file=sys.stderr)
        sys.exit(2)
    if OUTCOMES:  # a sweep whose jobs ran here: one line on how it went, then its exit code
        print(f"sweep: {outcome_summary(OUTCOMES)}", file=sys.stderr)
        sys.exit(exit_code(OUTCOMES, sweep=True))


if __name__ == "__main__":
    main()
