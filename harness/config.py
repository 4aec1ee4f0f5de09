"""Config schema (types here, values in conf/*.yaml) and validation of values.

Hydra merges the YAML groups onto these dataclasses, so a key that is not declared
here is rejected. `validate` then checks values and raises ConfigError with a
one-line message that names the problem and the fix. What a model spec (`arch.model`,
`method.drafter`) names is decided in harness/models/resolve.py, not here.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from engines.registry import get_engine
from harness.bounds import (MAX_BLOCK, MAX_CONTEXT, MAX_COUNT, MAX_NEW_TOKENS, MAX_REPS, MAX_TEMPERATURE, MAX_WARMUP,
                            WEEK_S, check_block)
from harness.errors import ConfigError

DTYPES = ("float32", "float16", "bfloat16", "native")
KV_DTYPES = ("native", "float16", "bfloat16", "q8", "q4")
ROLLBACKS = ("auto", "capture", "recompute", "replay")
EXECUTIONS = ("eager", "static")


@dataclass
class ArchConfig:
    name: str = MISSING  # label for records and report tables
    model: str = MISSING  # "fixture:<name>", a named model (smollm2), a .gguf file or a local checkpoint directory
    dtype: str = "float32"  # float32 | float16 | bfloat16 | native (as stored)
    gguf_dequantize: bool = True  # GGUF targets: every tensor dequantized to dtype; false keeps Q4_0/Q4_1/Q8_0
    #                               as MLX quantization and casts only float tensors (dtype=native keeps them too)


@dataclass
class ForceConfig:
    # Forced acceptance (engines/runtime/forced.py): the round's accept decision replaced, all its work real.
    accepted: Optional[int] = None  # accept exactly min(n, K) drafts every round
    rate: Optional[float] = None  # or: accept each position with this probability given the one before
    seed: int = 0  # the rate's draws (keyed by output position: a cell replays the same counts)


@dataclass
class MethodConfig:
    name: str = MISSING  # a registered engine: base, ngram, control, dflash_a, dflash_c, mtp, eagle3, mlx_lm, dflash_zlab
    label: Optional[str] = None  # a name of your own for the arm in reports (e.g. llama.cpp+lookup); part of the cell
    block_size: Optional[int] = None  # tokens verified per round = K drafts + 1; base ignores it;
    #                                   dflash: null = the drafter's own block_size
    drafter: Optional[str] = None  # dflash: drafter dir or fixture:<name>; null = the fixture arch's own;
    #                                mtp: checkpoint holding mtp.* tensors; null = the target's own;
    #                                draft_model: a model spec like arch.model; null = fixture:llama on fixtures
    verify: str = "batched"  # batched: K+1 tokens in one target forward; sequential: one forward per token
    depth: int = 4  # eagle3: tree depth (drafter steps per round)
    top_k: int = 4  # eagle3: children per expanded node, and nodes expanded per depth
    total_tokens: int = 16  # eagle3: tree nodes kept for verification
    min_ngram: int = 1  # ngram: shortest suffix n-gram to match
    max_ngram: int = 3  # ngram: longest suffix n-gram to match (tried first)
    command: Optional[str] = None  # subprocess: the engine's command line (engines/arms/outside.py: the protocol)
    startup_timeout_s: float = 300.0  # subprocess / server: how long it may take to be ready (healthy)
    request_timeout_s: float = 300.0  # subprocess / server: the longest a whole request may take
    url: Optional[str] = None  # server: http://host:port of an OpenAI-compatible server
    model: Optional[str] = None  # server: the model name sent in requests (null = none: the one it loaded)
    launch: Optional[str] = None  # server: command line that starts it for the cell (null = already running)
    force: ForceConfig = field(default_factory=ForceConfig)  # drafting methods: a chosen acceptance (not lossless)
    draft_threshold: Optional[float] = None  # adaptive draft length (draft_model, dflash_a, eagle3's chain): drafts
    #                                          stop before the first the drafter gives less than this probability;
    #                                          null = always K
    draft_bandit: bool = False  # adaptive draft length (draft_model): a UCB1 bandit picks K in 1..block-1 each round
    options: Dict[str, Any] = field(default_factory=dict)  # settings of one method alone, declared by its engine
    #                                                         (Engine.options), e.g. suffix's method.options.workload


@dataclass
class BenchConfig:
    suite: str = "builtin"  # builtin | mtbench | humaneval | gsm8k | a local .jsonl, or several joined by + (harness/prompts)
    categories: List[str] = field(default_factory=list)  # keep only these categories; empty = all
    max_prompts: Optional[int] = None  # first N prompts after filtering; null = all
    per_category: Optional[int] = None  # first N prompts of each category (before max_prompts); null = all
    max_new_tokens: int = 64
    warmup: int = 1  # untimed generations per arm before timing (first calls compile)
    warmup_scope: str = "auto"  # first: before the first prompt; every: before each prompt; auto: every on GPUs
    warmup_tokens: Optional[int] = None  # tokens of the warm-up on prompts after the first; null = max(8, 2 x block)
    reps: int = 3  # timed generations per arm and prompt, interleaved method/base
    cooldown_s: float = 0.0  # sleep between reps (laptops throttle: 60 s is common there)
    seed: int = 0
    temperature: float = 0.0  # 0 = greedy
    profile: bool = True  # one extra, separately timed pass per prompt with per-phase barriers
    profile_every: int = 1  # profile every Nth prompt (turn) only, the first included
    chat_template: bool = True  # wrap turns in the tokenizer's chat template when it has one
    stop_at_eos: bool = False  # benchmarks generate exactly max_new_tokens by default
    truncate_prompts: bool = False  # a prompt too long for the model's context: false refuses the cell,
    #                                 true keeps its last tokens that fit (the record says how many it had)
    context: int = 0  # tokens of earlier conversation before each prompt (harness/context.py); 0 = none
    context_source: str = "sharegpt"  # where that conversation comes from: sharegpt (the packaged file) or a file
    context_reuse: bool = True  # feed that prefix once per arm and restore it for every prompt, as a server's
    #                             prompt cache does (time to first token then excludes the prefix's prefill)


@dataclass
class KVConfig:
    name: str = "native"  # native | float16 | bfloat16 | q8 | q4
    group_size: int = 64  # quantization group for q8/q4 (must divide the head dim)


@dataclass
class DispatchConfig:
    # How target forwards reach a GPU (engines/runtime/dispatch.py); null = the device's default.
    stage_every: Optional[int] = None  # queue the graph every N layers (default 0 = never: it did not pay on the H200)
    stable_attention: Optional[bool] = None  # multi-token attention over the cache's 256-key buffer, masked,
    #                                          so cuDNN plans per bucket, not per round (default: on under CUDA)
    small_m_gemm: Optional[bool] = None  # matmuls over 2-16 rows on the harness's tensor-core kernel
    #                                      (engines/kernels/gemm.py; CUDA only; default: on under CUDA)
    fuse_rounds: Optional[bool] = None  # execution=static: compile each round whole (engines/methods/device.py)


@dataclass
class GateCheck:
    name: str = MISSING  # what the check claims, shown in the gate table
    overrides: List[str] = field(default_factory=list)  # the cell, as command-line overrides
    min: Dict[str, float] = field(default_factory=dict)  # record summary metric -> lowest passing value
    max: Dict[str, float] = field(default_factory=dict)  # record summary metric -> highest passing value


@dataclass
class GateConfig:
    name: str = MISSING
    checks: List[GateCheck] = field(default_factory=list)


@dataclass
class Config:
    arch: ArchConfig = MISSING
    method: MethodConfig = MISSING
    bench: BenchConfig = field(default_factory=BenchConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    rollback: str = "auto"  # recurrent-state rollback: auto (fastest measured) | capture | recompute | replay
    execution: str = "eager"  # eager: rounds built op by op, read each round (the reference); static: rounds
    #                           that stay on the device, static caches, compiled phases, read one round late
    reference: str = "base"  # the arm every method run is paired with (e.g. dflash_c to time dflash_a against it)
    also_against: Optional[str] = None  # a second reference timed in the same reps (e.g. mlx_lm: what users run
    #                                     today), its speedup reported beside the reference's; null = none
    out_dir: str = "results/default"
    force: bool = False  # re-run cells whose record already exists
    reuse_other_code: bool = False  # keep records measured by other code (another commit, MLX or mlx-lm version)
    #                                 as long as their inputs' content is this run's (harness/identity.py)
    allow_shared_device: bool = False  # let cells launched in parallel time on one device at once (ratios suffer)
    lock_timeout_s: Optional[float] = None  # give up (exit 5) when another run holds the device longer; null = wait
    gate: Optional[GateConfig] = None  # set by +gate=<name>: run its checks, exit 1 if any falls short


GROUPS = {"arch": ArchConfig, "method": MethodConfig, "bench": BenchConfig, "kv": KVConfig}
NESTED = {"dispatch": DispatchConfig}  # sections of the schema without a YAML group
OPTION_GROUPS = ("sweep", "gate")  # groups that are whole experiments, added with +<group>=<name>


def register_configs() -> None:
    ConfigStore.instance().store(name="schema", node=Config)


def conf_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "conf"


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def _one_of(what: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{what}={value!r} is not valid; use one of: {', '.join(map(str, valid))}")


def arm_of(spec: str, execution: str, key: str = "reference") -> tuple[str, str]:
    """(engine name, execution) of an arm named `spec`: a method name, or name:eager / name:static to
    run it in another execution than the cell's (`execution`); ConfigError naming `key` otherwise."""
    name, _, ex = str(spec).partition(":")
    ex = ex or execution
    if ex not in EXECUTIONS:
        raise ConfigError(f"{key}={spec!r}: {ex!r} is not an execution; use {name}, {name}:eager or {name}:static")
    try:
        return get_engine(name).name, ex
    except KeyError as e:
        raise ConfigError(f"{key}: {e.args[0]}") from None


def _check_outside(method, knobs) -> None:
    """An outside arm without what reaches it is a mistake, not an unsupported cell: a sweep
    that holds one must not end green."""
    from urllib.parse import urlparse

    if "command" in knobs and not method.get("command"):
        raise ConfigError(f"method={method.name} needs method.command=<the engine's command line>, e.g. "
                          "\"method.command='python examples/mlx_lm_adapter.py --model <dir>'\"")
    for key in ("command", "launch"):
        if key in knobs and method.get(key):
            try:
                words = shlex.split(str(method[key]))
            except ValueError as e:  # an unclosed quote: the command line cannot be split into words
                raise ConfigError(f"method.{key}={method[key]!r} is not a command line ({e}); close its quotes") from None
            if not words:
                raise ConfigError(f"method.{key} is empty; give the engine's command line")
    if "url" in knobs:
        url = method.get("url")
        if not url:
            raise ConfigError(f"method={method.name} needs method.url=http://host:port (and method.launch=<command> "
                              "to have the harness start the server)")
        parts = urlparse(str(url))
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"method.url={url!r} is not an http(s) URL with a host; e.g. http://127.0.0.1:8080")


def validate(cfg) -> None:
    """Check every value the schema cannot; raises ConfigError."""
    try:
        engine = get_engine(cfg.method.name)
    except KeyError as e:
        raise ConfigError(f"{e.args[0]} (choose with method=<name>)") from None
    _check_method(cfg.method, engine.knobs)
    check_options(cfg.method, engine)
    _check_outside(cfg.method, engine.knobs)
    _one_of("arch.dtype", cfg.arch.dtype, DTYPES)
    _one_of("method.verify", cfg.method.verify, ("batched", "sequential"))
    _one_of("bench.warmup_scope", cfg.bench.warmup_scope, ("auto", "first", "every"))
    _one_of("kv.name", cfg.kv.name, KV_DTYPES)
    _one_of("kv.group_size", cfg.kv.group_size, (32, 64, 128))
    _one_of("rollback", cfg.rollback, ROLLBACKS)
    _one_of("execution", cfg.execution, EXECUTIONS)
    method = (get_engine(cfg.method.name).name, cfg.execution)
    reference = arm_of(cfg.reference, cfg.execution, "reference")
    if cfg.also_against is not None:
        also = arm_of(cfg.also_against, cfg.execution, "also_against")
        if also in (reference, method):
            raise ConfigError(f"also_against={cfg.also_against} is already an arm of the cell (the method or the "
                              "reference); name another implementation, or leave it null")
    _check_dispatch(cfg.dispatch)
    _check_threshold(cfg.method, get_engine(cfg.method.name, cfg.execution))
    _check_bandit(cfg.method, get_engine(cfg.method.name, cfg.execution))
    if "block_size" in engine.knobs:
        check_block(cfg.method.block_size, cfg.bench.max_new_tokens)
    if cfg.lock_timeout_s is not None:
        if not isinstance(cfg.lock_timeout_s, bool) and isinstance(cfg.lock_timeout_s, (int, float)) \
                and cfg.lock_timeout_s < 0:
            raise ConfigError(f"lock_timeout_s={cfg.lock_timeout_s} is not valid; use null (wait) or seconds >= 0")
        check_range("lock_timeout_s", cfg.lock_timeout_s, 0, WEEK_S, "seconds")
    _check_bench(cfg.bench)


def _check_method(m, knobs) -> None:
    # The knobs this method reads, each a finite number in its range.
    if "block_size" in knobs and not (m.block_size is None and "drafter" in knobs):  # None: the drafter's own
        if isinstance(m.block_size, bool) or not isinstance(m.block_size, int) or m.block_size < 2:
            raise ConfigError(f"method.block_size={m.block_size!r} is not valid for {m.name}: it is the number of "
                              "tokens verified per round (drafts + 1) and must be an integer >= 2")
        check_range("method.block_size", m.block_size, 2, MAX_BLOCK, "tokens verified in one round")
    for key, (low, high, what) in METHOD_RANGES.items():
        if key in knobs:
            check_range(f"method.{key}", m[key], low, high, what)
    if "min_ngram" in knobs and m.max_ngram < m.min_ngram:
        raise ConfigError(f"ngram sizes min_ngram={m.min_ngram}, max_ngram={m.max_ngram} are "
                          "not valid; need 1 <= min_ngram <= max_ngram")
    _check_force(m)
    if "depth" in knobs and m.total_tokens < m.depth:
        raise ConfigError(f"eagle3 tree depth={m.depth}, top_k={m.top_k}, total_tokens={m.total_tokens} is not "
                          "valid; need depth >= 1, top_k >= 1 and total_tokens >= depth")


def check_options(m, engine) -> None:
    """method.options against the engine's declared options: a value of another type than the
    default's (a number must be finite) is refused with what it takes; a name no method declares
    (a typo) is refused with every method's options; one another method declares is ignored here,
    as a knob this method does not read is (a sweep crosses methods)."""
    given = getattr(m, "options", None) or {}
    for name, value in given.items():
        if name not in engine.options:
            by_method = _options_by_method()
            if any(name in names for names in by_method.values()):
                continue
            takes = "; ".join(f"{k}: {', '.join(sorted(v))}" for k, v in sorted(by_method.items()))
            raise ConfigError(f"method.options.{name}: no method has such an option; {m.name} takes "
                              f"{', '.join(engine.options) or 'none'} (every method's: {takes or 'none'})")
        default = engine.options[name]
        kind = bool if isinstance(default, bool) else (int, float) if isinstance(default, float) else type(default)
        if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, kind):
            raise ConfigError(f"method.options.{name}={value!r} is not valid for {m.name}: it takes a "
                              f"{type(default).__name__} (default {_yaml(default)})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"method.options.{name}={value} is not a finite number; give {m.name} a finite one")


def _options_by_method() -> dict[str, tuple[str, ...]]:
    # Each registered method that declares options, by name (imports their modules: the rare path of a refusal).
    from engines.registry import available

    out = {}
    for name in available():
        try:
            options = get_engine(name).options
        except ImportError:  # an arm whose optional dependency is not installed declares nothing here
            continue
        if options:
            out[name] = tuple(options)
    return out


def set_options(m, engine) -> dict:
    """The options method config `m` sets away from the engine's defaults: the part a cell's id holds
    (an option left at its default keeps the ids of cells recorded before it existed)."""
    values = engine.option_values(m)
    return {k: v for k, v in values.items() if v != engine.options[k]}


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _check_force(m) -> None:
    # method.force: one of accepted / rate, on a method whose rounds the loop accepts.
    f = m.get("force")
    if f is not None:  # checked even when unused: every number is, before anything runs
        check_range("method.force.seed", f.seed, 0, 2**32 - 1, "seed of the rate's draws")
    if f is None or (f.accepted is None and f.rate is None):
        return
    if f.accepted is not None and f.rate is not None:
        raise ConfigError(f"method.force.accepted={f.accepted} and method.force.rate={f.rate} are both set; "
                          "force a fixed count or a rate, not both")
    engine = get_engine(m.name)
    if not engine.drafts or engine.external:
        raise ConfigError(f"method.force applies to drafting methods whose rounds this harness accepts; {m.name} "
                          f"{'runs its own loop' if engine.external else 'drafts nothing'} (use ngram, mtp, eagle3, "
                          "dflash_a, dflash_c or draft_model)")
    if f.accepted is not None:
        if isinstance(f.accepted, bool) or not isinstance(f.accepted, int):
            raise ConfigError(f"method.force.accepted={f.accepted!r} is not an integer; give the drafts to accept "
                              "each round (0 up to the block's K)")
        check_range("method.force.accepted", f.accepted, 0, MAX_BLOCK, "drafts accepted each round")
    else:
        check_range("method.force.rate", f.rate, 0, 1, "each position's acceptance, given the one before")


def _check_threshold(m, engine) -> None:
    # method.draft_threshold: adaptive draft length, on an engine that drafts a varying count (not fixed shapes).
    t = m.get("draft_threshold")
    if t is None:
        return
    if not engine.adapts_drafts:
        raise ConfigError(f"method.draft_threshold applies to methods that draft a varying number of tokens a round "
                          f"(draft_model, dflash_a and eagle3's chain, eagerly); {m.name} under "
                          f"execution={engine.execution} drafts a fixed block: leave it null")
    check_range("method.draft_threshold", t, 0, 1, "the drafter's probability of its draft below which drafting stops")


def _check_bandit(m, engine) -> None:
    # method.draft_bandit: K picked each round, on an engine that can draft any K up to its block.
    if not m.get("draft_bandit"):
        return
    if not engine.bandit_drafts:
        raise ConfigError(f"method.draft_bandit applies to draft_model (eagerly); {m.name} under "
                          f"execution={engine.execution} does not pick its draft length: leave it false")
    if m.get("draft_threshold") is not None:
        raise ConfigError(f"method.draft_bandit=true and method.draft_threshold={m.draft_threshold} both choose the "
                          "draft length; set one of them")


# method knob -> (lowest, highest, what it sizes): each bound is what one round or one request can hold.
METHOD_RANGES = {
    "depth": (1, 64, "drafter steps per round"),
    "top_k": (1, 64, "children per expanded node"),
    "total_tokens": (1, MAX_BLOCK, "tree nodes verified per round"),
    "min_ngram": (1, 64, "tokens in the shortest suffix matched"),
    "max_ngram": (1, 64, "tokens in the longest suffix matched"),
    "startup_timeout_s": (0.001, WEEK_S, "seconds"),
    "request_timeout_s": (0.001, WEEK_S, "seconds"),
}


def check_range(key: str, value, low, high, what: str = "") -> None:
    """ConfigError unless `value` is a finite number (not a bool) in [low, high]; the line names
    the setting, the value and the bound."""
    unit = f" ({what})" if what else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{key}={value!r} is not a number; use a value in [{low:g}, {high:g}]{unit}")
    if not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not a finite number; use a value in [{low:g}, {high:g}]{unit}")
    if value < low:
        raise ConfigError(f"{key}={_num(value)} is not valid; it must be >= {low:g}{unit}")
    if value > high:
        raise ConfigError(f"{key}={_num(value)} is above the bound {high:g}{unit}; lower it")


def _num(value) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _check_dispatch(d) -> None:
    from engines.kernels.gemm import \
        available as gemm_available  # a CUDA kernel module: loads MLX, which the schema does not

    if d.stage_every is not None and d.stage_every < 0:
        raise ConfigError(f"dispatch.stage_every={d.stage_every} is not valid; use null (the device's "
                          "default), 0 (never) or a number of layers >= 1")
    if d.stage_every is not None:
        check_range("dispatch.stage_every", d.stage_every, 0, MAX_COUNT, "layers")
    if d.small_m_gemm and not gemm_available():  # the check Target makes, before any model loads
        raise ConfigError("dispatch.small_m_gemm=true needs MLX's CUDA backend (engines/kernels/gemm.py is a CUDA kernel); "
                          "leave it null or false on this machine")


def _check_bench(b) -> None:
    for key, (low, high, what) in BENCH_RANGES.items():
        check_range(f"bench.{key}", b[key], low, high, what)
    for key in ("max_prompts", "per_category", "warmup_tokens", "profile_every"):
        if b[key] is not None and b[key] < 1:
            raise ConfigError(f"bench.{key}={b[key]} is not valid; use null (all) or a count >= 1")
        if b[key] is not None:
            check_range(f"bench.{key}", b[key], 1, MAX_COUNT if key != "warmup_tokens" else MAX_NEW_TOKENS)


# bench setting -> (lowest, highest, why): sizes bounded so a typo cannot run for days or allocate without end.
BENCH_RANGES = {
    "max_new_tokens": (2, MAX_NEW_TOKENS, "a decode rate needs a token after the first"),
    "reps": (1, MAX_REPS, "timed generations per arm and prompt"),
    "warmup": (0, MAX_WARMUP, "untimed generations per arm"),
    "seed": (0, 2**32 - 1, "a random key's seed: keys hold seed, stream and position in 64 bits"),
    "cooldown_s": (0, 3600, "seconds between reps"),
    "temperature": (0, MAX_TEMPERATURE, "0 = greedy"),
    "context": (0, MAX_CONTEXT, "tokens of earlier conversation"),
}


def knobs_of(method_name: str) -> tuple[str, ...]:
    return get_engine(method_name).knobs


def canonical_cell(cfg) -> dict:
    """The parts of the config that decide the measurement, nothing else."""
    knobs = knobs_of(cfg.method.name)
    method = {"name": cfg.method.name, **{k: cfg.method[k] for k in knobs}}
    execution = cfg.get("execution") or "eager"  # configs composed before the axis existed have none
    if cfg.method.get("label"):  # a name of the user's for this arm (two servers launched two ways)
        method["label"] = cfg.method.label
    from engines.runtime.forced import Force  # here, not at the top: harness.blas must select before mlx loads

    force = Force.from_config(cfg.method.get("force"))
    if force is not None:  # only when set: ids stay
        method["force"] = force.describe()
    if cfg.method.get("draft_threshold") is not None:  # only when set: ids stay
        method["draft_threshold"] = cfg.method.draft_threshold
    if cfg.method.get("draft_bandit"):  # only when set: ids stay
        method["draft_bandit"] = True
    options = set_options(cfg.method, get_engine(cfg.method.name))
    if options:  # only those set away from the method's defaults: ids stay
        method["options"] = options
    dispatch = {k: v for k, v in OmegaConf.to_container(cfg.dispatch).items() if v is not None}
    arch = OmegaConf.to_container(cfg.arch, resolve=True)
    if arch.get("gguf_dequantize", True):
        arch.pop("gguf_dequantize", None)  # the default keeps ids of cells recorded before the key existed
    return {
        **({"dispatch": dispatch} if dispatch else {}),  # only when set: the device defaults keep ids as they were
        "arch": arch,
        "method": method,
        "kv": OmegaConf.to_container(cfg.kv, resolve=True) if cfg.kv.name in ("q8", "q4") else {"name": cfg.kv.name},
        "bench": _bench_cell(cfg.bench),
        "rollback": cfg.rollback if method["name"] != "base" else None,
        "reference": cfg.reference if (method["name"], execution) != arm_of(cfg.reference, execution) else None,
        **({"execution": execution} if execution != "eager" else {}),  # eager: ids as before the axis
        **({"also_against": cfg.get("also_against")} if cfg.get("also_against") else {}),
    }


def _bench_cell(bench) -> dict:
    out = OmegaConf.to_container(bench, resolve=True)
    if not out.get("context"):  # no context: ids of cells recorded before the axis existed stay as they were
        out.pop("context", None)
        out.pop("context_source", None)
        out.pop("context_reuse", None)
    return out


MADE_BY_RUN: list = []  # folders out_dir needed that did not exist before this run, leaf first


def check_out_dir(out_dir: str, key: str = "out_dir", example: str = "out_dir=results/mine") -> None:
    """out_dir (or the Hydra dir `key`) exists or can be made, and takes a file; else ConfigError."""
    import tempfile
    from pathlib import Path

    path = Path(out_dir).expanduser()
    made = [p for p in [path, *path.parents] if not p.exists()]  # removed again: bad input leaves no folder
    MADE_BY_RUN.extend(p.resolve() for p in made)  # Hydra makes them again for the run; gone if it stops on bad input
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        for p in made:
            p.rmdir()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ConfigError(f"{key}={out_dir} cannot hold the records: {why} ({e.filename or path}); "
                          f"pass a writable directory, e.g. {example}") from None
