"""Everything `python -m harness` checks before the first cell runs, for every cell it will run.

The command line's overrides are checked against the config groups and the schema, then
every job is composed as Hydra will compose it (a sweep's whole cross product, its sweep
file's axes included; a gate's every check) and its values validated: types, ranges, the
prompt suite, the context source, the context against the model's positions, out_dir. A
sweep whose third cell is bad input is refused before its first runs: one `error:` line
(ConfigError) naming the job and the key, exit 2, nothing written.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from harness.config import GROUPS, NESTED, OPTION_GROUPS, Config, check_out_dir, conf_dir, group_options, validate
from harness.errors import ConfigError, TargetError
from harness.flags import compose_first_job, composition_error, first_line, override_args, parse_overrides

MAX_JOBS = 10_000  # a sweep larger than this is a typo in an axis, not an experiment


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
            _check_dotted(key, sections[key.split(".", 1)[0]])
        elif key not in top:
            raise ConfigError(f"unknown key {key!r}; top-level keys: {', '.join(sorted(top))}, "
                              f"groups: {', '.join([*GROUPS, *OPTION_GROUPS])}")


def _check_dotted(key: str, cls) -> None:
    # "method.force.accepted": each part a field of the dataclass before it (nested ones included).
    parts = key.split(".")
    for i, name in enumerate(parts[1:], 1):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if name not in fields:
            raise ConfigError(f"unknown key {key!r}; {'.'.join(parts[:i])} has: {', '.join(fields)}")
        kind = fields[name].default_factory if fields[name].default_factory is not dataclasses.MISSING else None
        if not (kind and dataclasses.is_dataclass(kind)):
            return  # a leaf (or a dict-valued field, whose keys are the user's)
        cls = kind


def _search_dirs(overrides) -> list:
    # Config dirs added with hydra.searchpath=[file://...] also hold group options.
    for o in overrides:
        if o.key_or_group == "hydra.searchpath":
            return [Path(str(p)[len("file://"):]) for p in o.value() if str(p).startswith("file://")]
    return []


def preflight(args: list[str]) -> None:
    """Compose the first job (Hydra config included) and check the dirs Hydra makes before any
    job, then every job of the run (`check_jobs`); ConfigError naming the key and the job."""
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
    check_jobs(args, cfg)


def job_overrides(args: list[str], first) -> list[list[str]]:
    """Each job's overrides, as Hydra's basic sweeper will make them: the sweep file's axes
    (hydra.sweeper.params) and the command line's, crossed; one job outside a multirun."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    given = override_args(args)
    params = dict(first.hydra.sweeper.get("params") or {}) if _multirun(args, first) else {}
    if not params and not any(o.is_sweep_override() for o in parse_overrides(args)):
        return [given]
    try:
        parsed = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()] + given)
        (jobs,) = BasicSweeper.split_arguments(parsed, None)
    except Exception as e:  # noqa: BLE001 -- Hydra's grammar and sweeper errors: their first line
        raise ConfigError(f"cannot expand the sweep: {first_line(e)}") from None
    if len(jobs) > MAX_JOBS:
        raise ConfigError(f"the sweep has {len(jobs)} jobs, more than {MAX_JOBS}; check its axes")
    return jobs


def _multirun(args: list[str], first) -> bool:
    from hydra.types import RunMode

    return bool({"-m", "--multirun"} & set(args)) or first.hydra.get("mode") == RunMode.MULTIRUN


def check_jobs(args: list[str], first) -> None:
    """Compose and validate every job before the first runs (a gate: every check's cell)."""
    from hydra import compose, initialize_config_dir

    jobs = job_overrides(args, first)
    seen = Seen()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        for i, overrides in enumerate(jobs, 1):
            where = f"job {i} of {len(jobs)} ({' '.join(overrides)})" if len(jobs) > 1 else ""
            cfg = _compose(compose, overrides, where)
            if cfg.get("gate") is not None:
                check_gate(cfg.gate, overrides, compose, seen)
            else:
                check_cell(cfg, seen, where)


def _compose(compose, overrides: list[str], where: str):
    try:
        return compose(config_name="config", overrides=list(overrides))
    except Exception as e:  # noqa: BLE001 -- composition errors (types, missing options): one line each
        raise composition_error(e, where) from None


class Seen:
    """What earlier jobs already checked (suites, models, out_dirs): each is checked once."""

    def __init__(self):
        self.suites, self.models, self.dirs = {}, {}, set()


def check_cell(cfg, seen: Seen, where: str = "") -> None:
    """ConfigError (prefixed with `where`) for anything in one cell's config that would refuse it
    once running: its values, its prompt suite, its context source, its sizes against the model."""
    try:
        validate(cfg)
        _check_suite(cfg.bench, seen)
        if cfg.bench.context:
            from harness.context import source_file

            source_file(cfg.bench.context_source)
        if str(cfg.out_dir) not in seen.dirs:
            check_out_dir(str(cfg.out_dir))
            seen.dirs.add(str(cfg.out_dir))
        _check_positions(cfg, seen)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


def _check_suite(bench, seen: Seen) -> None:
    from harness.prompts import load_suite

    key = (bench.suite, tuple(bench.categories), bench.max_prompts, bench.per_category)
    if key not in seen.suites:
        seen.suites[key] = load_suite(bench.suite, list(bench.categories), bench.max_prompts, bench.per_category)


def _check_positions(cfg, seen: Seen) -> None:
    """bench.context and the token budget against the model's positions (at least one prompt
    token, the budget, a last block): what would stop the cell after its model loaded."""
    from engines.registry import get_engine
    from harness.bounds import positions_needed
    from harness.models.load import model_context
    from harness.models.resolve import resolve_model

    key = (cfg.arch.model, cfg.arch.dtype, cfg.arch.gguf_dequantize)
    if key not in seen.models:
        try:
            seen.models[key] = model_context(resolve_model(*key))
        except TargetError:  # a damaged checkpoint is the cell's `error` record, not bad input
            seen.models[key] = None
    positions = seen.models[key]
    block = cfg.method.block_size if "block_size" in get_engine(cfg.method.name).knobs else None
    need = positions_needed(1 + cfg.bench.context, cfg.bench.max_new_tokens, block or 1)
    if positions is not None and need > positions:
        raise ConfigError(f"bench.context={cfg.bench.context} + bench.max_new_tokens={cfg.bench.max_new_tokens}"
                          f"{f' + {block - 1} of a last block' if block and block > 1 else ''} + a prompt need "
                          f"at least {need} positions; {cfg.arch.model} holds {positions} (max_position_embeddings): "
                          "lower bench.context or bench.max_new_tokens")


def check_gate(gate, overrides: list[str], compose, seen: Seen) -> None:
    """The gate file's own shape (a name, at least one check, each with a name, overrides and
    finite bounds), then every check's cell as the gate will compose it."""
    name = gate.get("name") if not _missing(gate, "name") else None
    if not name:
        raise ConfigError("the gate file has no `name`; give it one (conf/gate/ci.yaml is an example)")
    checks = gate.get("checks")
    if not checks:
        raise ConfigError(f"gate {name} has no checks: a gate that measures nothing cannot pass; "
                          "list at least one under gate.checks")
    task = [o for o in overrides if not o.lstrip("+~").startswith("gate")]
    for i, check in enumerate(checks, 1):
        label = check_shape(name, i, check)
        cfg = _compose(compose, [*task, *check.overrides, "force=true"], f"gate {name} check {label}")
        check_cell(cfg, seen, f"gate {name} check {label}")


def check_shape(gate: str, i: int, check) -> str:
    """The check's name, quoted; ConfigError for a check without one, or a bound that is not a finite number."""
    if _missing(check, "name") or not str(check.name).strip():
        raise ConfigError(f"gate {gate}: check {i} has no `name`; every check needs one (what it claims)")
    for side in ("min", "max"):
        for metric, bound in (check.get(side) or {}).items():
            if isinstance(bound, bool) or not isinstance(bound, (int, float)) or not math.isfinite(bound):
                raise ConfigError(f"gate {gate} check {check.name!r}: {side}.{metric}={bound!r} is not a finite number")
    return repr(str(check.name))


def _missing(node, key: str) -> bool:
    from omegaconf import OmegaConf

    return OmegaConf.is_missing(node, key)
