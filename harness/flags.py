"""Hydra's own command-line flags, told apart from overrides: both apps (`python -m harness`,
`python -m train`) check their overrides before Hydra runs, and a flag's value
(`--cfg job`) must never be read as one."""

from __future__ import annotations

from harness.errors import ConfigError

# Flags that take the next argument as their value (`--cfg job`), and --info's optional one.
VALUE_FLAGS = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd",
               "--config-dir", "--experimental-rerun"}
INFO_FLAGS, INFO_VALUES = {"-i", "--info"}, {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
ONLY_ONE = "Only one of"  # the start of Hydra's ValueError for flags that exclude each other (-m with --cfg)


def override_args(args: list[str]) -> list[str]:
    """The command-line arguments that are overrides: Hydra's flags and their values left out."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
        elif a.startswith("-"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            skip = "=" not in a and (a in VALUE_FLAGS or (a in INFO_FLAGS and nxt in INFO_VALUES))
        else:
            out.append(a)
    return out


def parse_overrides(args: list[str]) -> list:
    """The command line's overrides as Hydra parses them (flags aside); ConfigError with
    Hydra's first line where its grammar refuses one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(override_args(args))
    except Exception as e:  # noqa: BLE001 -- Hydra's grammar errors: keep their first line
        raise ConfigError(f"cannot parse the overrides: {first_line(e)} (grammar: "
                          "https://hydra.cc/docs/advanced/override_grammar/basic/)") from None


def check_sweep_mode(overrides: list, args: list[str], hydra_cfg) -> None:
    """ConfigError where an override lists several values but the run is not a multirun (no -m
    and no config that sets hydra.mode): Hydra's own refusal is a paragraph and a hint."""
    from hydra.types import RunMode

    sweeps = [o.input_line for o in overrides if o.is_sweep_override()]
    multirun = {"-m", "--multirun"} & set(args) or hydra_cfg.get("mode") == RunMode.MULTIRUN
    if sweeps and not multirun:
        raise ConfigError(f"{sweeps[0]} lists several values: add -m (--multirun) to run one job per value, "
                          "or give one value")


def first_job(overrides: list) -> list[str]:
    """Parsed overrides as the first job of a sweep gets them (each axis at its first value):
    what a preflight composes to check the config before Hydra starts."""
    return [o.input_line if not o.is_sweep_override() else
            f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" for o in overrides]


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def composition_error(e: BaseException, where: str = "") -> ConfigError:
    """Hydra's composition error as one line: where, the key it names, its first line, and for an
    option a method's conf file does not list, how to add it."""
    cause = e.__cause__ or e
    key = getattr(cause, "full_key", None) or ""
    hint = ""
    if key.startswith("method.options.") and "not in struct" in first_line(cause):
        hint = ("; this method's conf file does not list that option: add it with ++method.options.<name>=<value> "
                "(the method then checks its name and type)")
    return ConfigError(f"{where + ': ' if where else ''}{key + ': ' if key else ''}{first_line(cause)}{hint}")


def compose_first_job(config_name: str, args: list[str]):
    """The app's config as the first job of its command line gets it (Hydra config included),
    composed before Hydra runs: ConfigError with Hydra's first line and the key it names for a
    bad override or value, or for a sweep value without -m."""
    from hydra import compose, initialize_config_dir

    from harness.config import conf_dir  # the schema imports Hydra, which this module loads only to compose

    overrides = parse_overrides(args)
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = compose(config_name=config_name, overrides=first_job(overrides), return_hydra_config=True)
    except Exception as e:  # noqa: BLE001 -- composition errors (types, missing options): one line each
        raise composition_error(e) from None
    check_sweep_mode(overrides, args, cfg.hydra)
    return cfg
