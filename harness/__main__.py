"""`python -m harness [overrides]`: run one cell, or a sweep with +sweep=<name>.

Before Hydra runs, the overrides are checked against the config groups and the schema, and
every job the command will run is composed and validated (harness/preflight.py), so a typo,
a bad value in a sweep's third cell or an unusable out_dir gets one line naming the problem
and the fix (exit 2) before anything runs. Whatever escapes a job leaves through the fault
boundary (harness/faults.py): one `error:` line and an exit code, exit 1 only for a gate that
fell short. Exit codes: harness/run.py EXIT_CODES (docs/exit-codes.md).
"""

from __future__ import annotations

from harness import blas

blas.select()  # before anything imports mlx: a BLAS serves libmlx only if it is in the global scope first

import sys  # noqa: E402

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from harness.config import MADE_BY_RUN, conf_dir, register_configs  # noqa: E402
from harness.errors import ConfigError  # noqa: E402
from harness.faults import exit_for, name_path  # noqa: E402
from harness.flags import ONLY_ONE, parse_overrides  # noqa: E402
from harness.preflight import check_overrides, preflight  # noqa: E402

APP = "python -m harness"
_GATE_FELL_SHORT = False  # set by a gate whose bound fell short: the only run that exits 1
INTERRUPTED = ("the records of cells that finished are kept, the cell that was running wrote nothing (run the same "
               "command again: finished cells are skipped)")


@hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    blas.select()  # once more in a launcher's worker process, which never ran this module's top
    try:
        _job(cfg)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 -- the fault boundary: one line and a code, never Hydra's exit 1
        sys.exit(exit_for(_in_sweep(e, cfg), APP, INTERRUPTED))


def _job(cfg) -> None:
    """One job: a gate, or a cell (exits when this process runs a single cell; returns in a sweep)."""
    # Only now: harness.run (and the gate, through it) loads MLX, which must come after blas.select().
    from harness.gate import run_gate
    from harness.run import OUTCOMES, CellAborted, exit_code, run_cell

    global _GATE_FELL_SHORT
    name_path(cfg.out_dir, "out_dir")
    try:
        if cfg.gate is not None:
            code = run_gate(cfg)
            _GATE_FELL_SHORT = code == 1
            sys.exit(code)
        run_cell(cfg)
    except CellAborted as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.code)
    mode = _job_mode()
    if mode == "single":
        sys.exit(exit_code(OUTCOMES, sweep=False))
    if mode == "worker" and OUTCOMES and OUTCOMES[-1]["status"] == "error":
        # A job in its own process: failing it is how its launcher learns; the others run on.
        raise RuntimeError(f"cell {OUTCOMES[-1]['cell']}: error: {OUTCOMES[-1]['reason']}")


def _in_sweep(e: BaseException, cfg) -> BaseException:
    """Bad input met once cells have run (a prompt that fits no context, found when its model
    loaded) says what is already recorded; with nothing recorded, its folders go too."""
    if not isinstance(e, ConfigError):
        return e
    from harness.run import OUTCOMES

    done = len({o["cell"] for o in OUTCOMES})
    if not done:
        _drop_if_empty(cfg.out_dir)
        return e
    return ConfigError(f"{e} ({done} cell(s) of this run finished before it and keep their records; "
                       "no later cell ran)")


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


def _checked() -> int | None:
    """Everything checked before Hydra runs (harness/preflight.py): None, or the exit code."""
    from harness.faults import checked_home

    try:
        checked_home()
        overrides = parse_overrides(sys.argv[1:])
        check_overrides(overrides)
        register_configs()
        preflight(sys.argv[1:])
    except BaseException as e:  # noqa: BLE001 -- the fault boundary
        return exit_for(e, APP, "nothing ran")
    return None


def main() -> None:
    code = _checked()
    if code is not None:
        sys.exit(code)
    from harness.run import OUTCOMES, exit_code, outcome_summary  # loads MLX: kept off this module's import

    try:
        _hydra_main()
    except SystemExit as e:
        if e.code == 1 and not _GATE_FELL_SHORT:  # Hydra's own failure outside a job: 1 is a gate's code
            sys.exit(3)
        raise
    except ValueError as e:  # Hydra's refusal of flags that exclude each other (-m with --cfg): one line
        if not str(e).startswith(ONLY_ONE):
            sys.exit(exit_for(e, APP, INTERRUPTED))
        print(f"error: {e} (Hydra's rule; drop -m to see one job's config with --cfg)", file=sys.stderr)
        sys.exit(2)
    except BaseException as e:  # noqa: BLE001 -- what escaped Hydra itself (an interrupt between jobs)
        sys.exit(exit_for(e, APP, INTERRUPTED))
    if OUTCOMES:  # a sweep whose jobs ran here: one line on how it went, then its exit code
        print(f"sweep: {outcome_summary(OUTCOMES)}", file=sys.stderr)
        sys.exit(exit_code(OUTCOMES, sweep=True))


if __name__ == "__main__":
    main()
