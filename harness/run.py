"""One cell, end to end: validate, skip if already recorded, measure, write the record.

Bad input raises ConfigError before anything is written. Once the input is valid
every outcome is recorded: `ok`, `unsupported` (this method/model/backend
combination cannot run, with the reason) or `error` (with the exception), and a
sweep goes on to the next cell. Each outcome is also kept in OUTCOMES, from which
the command's exit code is made (EXIT_CODES; docs/exit-codes.md).
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from engines.drafters import drafter_kind
from engines.errors import DrafterError, Unsupported
from engines.home import home
from engines.registry import STATIC, get_engine
from engines.runtime.dispatch import dispatch_defaults
from engines.runtime.hidden import text_model
from harness import blas
from harness.config import arm_of, canonical_cell, validate
from harness.context import source_file
from harness.device_lock import LockTimeout, device_lock
from harness.env import STREAM_PROBE, LoadMeter, blas_warning, environment, stream_rate
from harness.errors import ConfigError
from harness.faults import Fault, os_error_line
from harness.identity import cell_inputs, stale
from harness.measure import Arms, measure_cell
from harness.models.gguf_import import conversion_record
from harness.models.load import check_shared_tokenizer, has_moe, load_target, model_context, model_dtype, weight_bytes
from harness.models.resolve import resolve_drafter, resolve_model
from harness.progress import PROGRESS
from harness.prompts import load_suite, suite_sources
from harness.records import SCHEMA_VERSION, cell_id, multirun_id, read_record, write_record

# What `python -m harness` exits with. A sweep exits 3 when any cell errored (after running the
# rest); its unsupported cells are expected outcomes of a grid, so they alone leave it at 0.
EXIT_CODES = {"ok": 0, "gate": 1, "bad input": 2, "error": 3, "unsupported": 4, "lock timeout": 5}
OUTCOMES: list[dict] = []  # one {"cell", "status", "reason", "path"} per cell this process ran or skipped

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_cell(cfg) -> Path | None:
    """Measure the cell `cfg` names and write its record; returns the record path."""
    validate(cfg)
    t_resolve = time.perf_counter()
    ckpt = resolve_model(cfg.arch.model, cfg.arch.dtype, cfg.arch.gguf_dequantize, log)
    t_resolve = time.perf_counter() - t_resolve  # a GGUF's conversion, once per file and dtype (else a lookup)
    prompts = load_suite(cfg.bench.suite, list(cfg.bench.categories), cfg.bench.max_prompts, cfg.bench.per_category)
    suite = suite_sources(cfg.bench.suite)  # the prompt files read: path, sha256, package version
    cell = canonical_cell(cfg)
    cid = cell_id(cell)
    path = Path(cfg.out_dir) / f"{cid}.json"
    head = PROGRESS.begin_job()
    sweep = multirun_id()
    inputs = measured_inputs(cfg, ckpt, suite)
    reuse = Reuse(cfg.force, cfg.reuse_other_code, inputs, sweep)
    if _skipped(head, cid, path, reuse, any(o["cell"] == cid for o in OUTCOMES)):
        return path
    turns = sum(len(p.turns) for p in prompts)
    log(f"{head} {cid}: {len(prompts)} prompts ({turns} turns), {cfg.bench.max_new_tokens} new tokens each")
    if warning := blas_warning(environment()):  # None unless the reference BLAS serves CPU matmuls
        log(warning)
    try:
        with device_lock(cfg.allow_shared_device, cfg.lock_timeout_s, log) as waited:
            if _skipped(" ", cid, path, reuse, quiet=True):  # another job may have run it meanwhile
                return path
            t0, started = time.perf_counter(), time.time()
            record = _measure(cfg, cell, cid, prompts, ckpt, suite)
            record["wall"] = {"resolve_model": round(t_resolve, 3), **record.get("wall", {})}
            record.update(multirun=sweep, inputs=inputs, run=RUN)
            record["device"] = {"held_from": started, "held_to": time.time(), "waited_s": round(waited(), 3),
                                "shared": bool(cfg.allow_shared_device)}
            if os.environ.get("SPEC_HARNESS_TEST_KILL") and os.environ["SPEC_HARNESS_TEST_KILL"] in cid:
                os._exit(137)  # test hook: a job killed after measuring, before its record exists
            # Written while the lock is held: a twin job waiting on it must find the record, not run again.
            _write_or_rescue(path, record, cid)
    except LockTimeout as e:
        raise CellAborted(str(e), EXIT_CODES["lock timeout"]) from None
    PROGRESS.measured_cell(cfg.method.name, time.perf_counter() - t0)  # waiting for the device excluded
    log(f"  -> {record['status']}: {_headline(record)}  [{path}]")
    for key in ("engine", "reference_engine", "also_engine"):  # what an arm saw that makes its numbers suspect
        for warning in (record.get(key) or {}).get("warnings") or []:
            log(f"  warning: {warning}")
    if record.get("wall"):
        log("  wall: " + ", ".join(f"{k} {v:.1f}s" for k, v in record["wall"].items()) + f" (cell {record['wall_s']:.1f}s)")
    return _outcome(cid, record, path)


class CellAborted(RuntimeError):
    """The cell could not start (the device stayed busy): nothing recorded; `code` is the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Reuse:
    """What decides whether a cell's existing record stands for this run: force re-runs every cell;
    a record is reused only when its inputs are `inputs` (by content), made by this code unless
    `other_code`; `sweep` is this multirun's id (None outside one)."""

    force: bool
    other_code: bool
    inputs: dict
    sweep: int | None


RUN = {"id": uuid.uuid4().hex, "pid": os.getpid()}  # this process's run: a gate evaluates only records it made


def measured_inputs(cfg, ckpt: Path, suite: list[dict]) -> dict:
    """The record's `inputs` (harness/identity.py): suite, target, each arm's drafter, the
    context file, the code. A drafter that does not exist is left out (the cell records why)."""
    drafters = {}
    arms = [("method", cfg.method.name), ("reference", arm_of(cfg.reference, cfg.execution)[0])]
    if cfg.also_against:
        arms.append(("also", arm_of(cfg.also_against, cfg.execution)[0]))
    for arm, name in arms:
        engine = get_engine(name)
        if "drafter" in engine.knobs:
            try:
                drafters[arm] = resolve_drafter(cfg, engine.drafter_kind)
            except Unsupported:
                drafters[arm] = None
    context = source_file(cfg.bench.context_source)[1] if cfg.bench.context else None
    return cell_inputs(suite, ckpt, drafters, context)


def _skipped(head: str, cid: str, path: Path, reuse: Reuse, seen_here: bool = False, quiet: bool = False) -> bool:
    """True (said and counted) when the cell's record at `path` means it need not run again."""
    old = read_record(path)
    skip, stale_why = _already_done(old, reuse, seen_here)
    if skip:
        log(f"{head} skip {cid}: {skip}")
        _outcome(cid, old, path)
    elif stale_why and not quiet:
        log(f"{head} {cid}: recorded at {path}, but {stale_why}: measuring it again")
    return skip is not None


def _already_done(old: dict | None, reuse: Reuse, seen_here: bool = False) -> tuple[str | None, str | None]:
    """(why the cell need not run again, or None; why its record is stale, or None). It need not
    run when an earlier job of this very sweep ran it (`seen_here`: in this process; else the
    record names this multirun), for jobs that differ only in an axis their method ignores; or
    when it is recorded ok from this run's inputs and code (unless force)."""
    if old is None:
        return None, None  # no record (or a broken one): run
    if seen_here or (reuse.sweep is not None and old.get("multirun") == reuse.sweep):
        return f"same cell as an earlier job of this sweep ({old['cell']['method']['name']} ignores the axis that differs)", None
    if old.get("status") != "ok" or reuse.force:
        return None, None
    why = stale(old.get("inputs"), reuse.inputs, reuse.other_code)
    if why:
        return None, why
    return "already recorded (force=true re-runs it)", None


def _write_or_rescue(path: Path, record: dict, cid: str) -> None:
    """write_record, or, when out_dir refuses it (a full disk, a folder gone or turned into a
    file), the measured record kept elsewhere and a Fault naming both places."""
    try:
        write_record(path, record)
        return
    except OSError as e:
        failure = os_error_line(e, f"cannot write the record {path}", path)
    for folder in (home() / "rescued", Path(tempfile.gettempdir()) / "spec-harness-rescued"):
        try:
            kept = folder / f"{cid}.{RUN['id'][:8]}.json"
            write_record(kept, record)
            raise Fault(f"{failure}; the measured record is kept at {kept}: copy it into out_dir as {path.name}")
        except OSError:
            continue
    raise Fault(f"{failure}; no other folder would take the measured record either (home {home()}, temp dir)")


def _outcome(cid: str, record: dict | None, path: Path) -> Path:
    status = record.get("status", "error") if record else "error"
    OUTCOMES.append({"cell": cid, "status": status, "reason": (record or {}).get("reason"), "path": str(path)})
    return path


def exit_code(outcomes: list[dict], sweep: bool) -> int:
    """0 when every cell is ok; one cell: 3 for `error`, 4 for `unsupported`; a sweep: 3 when any errored."""
    statuses = {o["status"] for o in _per_cell(outcomes)}
    if "error" in statuses:
        return EXIT_CODES["error"]
    if "unsupported" in statuses and not sweep:
        return EXIT_CODES["unsupported"]
    return EXIT_CODES["ok"]


def _per_cell(outcomes: list[dict]) -> list[dict]:
    # Jobs that repeat a cell (an axis its method ignores) count once, with the cell's last word.
    return list({o["cell"]: o for o in outcomes}.values())


def outcome_summary(outcomes: list[dict]) -> str:
    """One line: how many cells ended how, and which failed (for the end of a sweep)."""
    outcomes = _per_cell(outcomes)
    counts = {}
    for o in outcomes:
        counts[o["status"]] = counts.get(o["status"], 0) + 1
    line = f"{len(outcomes)} cell(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    failed = [f"{o['cell']} ({(o['reason'] or '').splitlines()[0][:200]})" for o in outcomes if o["status"] == "error"]
    return line + (f"; failed: {'; '.join(failed)}" if failed else "")


def _measure(cfg, cell: dict, cid: str, prompts, ckpt: Path, suite: list[dict]) -> dict:
    record = {"schema": SCHEMA_VERSION, "cell_id": cid, "cell": cell,
              "config": OmegaConf.to_container(cfg, resolve=True), "env": environment(),
              "suite": suite,
              "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    t0 = time.perf_counter()
    arms = None
    try:
        for name in (cfg.method.name, arm_of(cfg.reference, cfg.execution)[0]):
            _method_cfg(cfg, name)  # a drafter that does not exist is unsupported before the model loads
        t_load = time.perf_counter()
        model, tokenizer = load_target(ckpt, cfg.arch.dtype)
        record["model"] = {"path": str(ckpt), "model_type": getattr(model, "model_type", None),
                           "dtype": model_dtype(model), "quantization": _quantization(ckpt),
                           "gguf": conversion_record(ckpt)}
        _check_supported(model, cfg, record["env"])
        record["ceiling"] = decode_ceiling(model)
        arms = _build_arms(model, tokenizer, cfg)
        record["wall"] = {"load": round(time.perf_counter() - t_load, 3)}  # target, drafter and arms
        record["cache"] = vars(arms.method.target.layout)
        started = time.perf_counter()
        progress = lambda done, total: log(f"  turn {done}/{total}  {time.perf_counter() - started:.1f}s")
        with LoadMeter() as load:
            measured = measure_cell(arms, tokenizer, prompts, cfg.bench, progress, model_context(ckpt), log)
            record["wall"].update(measured.pop("wall"))
            record.update(measured)
        record["load"] = load.record
        record["engine"] = arms.method.describe()  # after measuring: rollback=auto has picked its strategy
        if arms.method.force is not None:  # a chosen acceptance: its output is not the target's
            record["forced"] = arms.method.force.describe()
        if record["engine"].get("acceptance_observed") is False:
            _unobserved_acceptance(record["summary"])
        if arms.base is not None and not arms.reference_is_base:  # what the ratio is against, what it cannot show
            record["reference_engine"] = arms.base.describe()
        if arms.also is not None:
            record["also_engine"] = arms.also.describe()
        record["status"] = "ok"
    except ConfigError:
        raise
    except Unsupported as e:
        record.update(status="unsupported", reason=str(e))
    except Exception as e:  # noqa: BLE001 -- any failure of a valid cell is recorded, and the sweep goes on
        reason = _known_unsupported(e)
        if reason:
            record.update(status="unsupported", reason=reason)
        else:
            record.update(status="error", reason=f"{type(e).__name__}: {e}",
                          traceback=traceback.format_exc(limit=-8))
    finally:
        for engine in arms.engines() if arms else []:
            engine.close()  # an outside engine's process stops with its cell
    record["wall_s"] = round(time.perf_counter() - t0, 3)
    if "wall" in record:  # where the cell's wall time went; `other`: ceiling probe, calibration-free bookkeeping
        record["wall"]["other"] = round(record["wall_s"] - sum(record["wall"].values()), 3)
    return record


def _unobserved_acceptance(summary: dict) -> None:
    """An arm that cannot see its rounds (a server's stream, an engine that reports no counts)
    has its tokens per step inferred: tau and acceptance would read 100%, so none are given."""
    for key in ("tau", "acceptance_rate", "per_position_acceptance"):
        summary[key] = None
    summary["acceptance_unobserved"] = True


def _quantization(ckpt) -> dict | None:
    """bits / group size of an mlx-lm quantized checkpoint (its config's `quantization`), else None."""
    import json

    q = json.loads((Path(ckpt) / "config.json").read_text()).get("quantization")
    return {k: q[k] for k in ("bits", "group_size", "mode") if k in q} if q else None


def decode_ceiling(model) -> dict:
    """The physics a decode rate is compared with: weight bytes read per token over the
    rate at which this backend streams that many bytes through a matrix-vector product."""
    w = weight_bytes(model)
    gbs = stream_rate(w["dtype"], w["bytes"])
    return {"weight_bytes": w["bytes"], "dtype": w["dtype"], "stream_gbs": gbs,
            "probe": f"{STREAM_PROBE} in {w['dtype']}", "tps": gbs * 1e9 / w["bytes"]}


def _outside_footing() -> None:
    """Tell engines/arms/outside.py what this process computes on and what its children are given, so an
    engine the cell starts multiplies on the harness's BLAS (engines import nothing from the harness)."""
    from engines.arms import outside

    outside.FOOTING = outside.Footing(environ=blas.child_env, given=blas.child_blas(),
                                      library=environment().get("blas"), kind_of=blas.kind_of,
                                      chosen=blas.selection()["reason"], fix=blas.FIX)


def _build_arms(model, tokenizer, cfg) -> Arms:
    _outside_footing()
    auto = cfg.rollback == "auto"
    strategy = "capture" if auto else cfg.rollback  # auto: switched to the measured fastest before timing

    def engine(spec):
        name, execution = arm_of(spec, cfg.execution)
        method_cfg = _method_cfg(cfg, name)
        cls = get_engine(name, execution)
        if execution == "static" and cls.execution != "static" and not cls.external:
            raise Unsupported(f"{cls.name} has no device-resident engine yet (execution=static covers "
                              f"{', '.join(sorted(STATIC))}); run it with execution=eager")
        if "drafter" in cls.knobs and drafter_kind(cls.drafter_kind).found == "model":  # a whole LM: its tokenizer
            check_shared_tokenizer(tokenizer, Path(method_cfg.drafter))
        # its own Target, built to keep the hidden layers its drafter reads (cls.hidden_layers)
        eng = cls.build(model, method_cfg, kv=cfg.kv.name, rollback=strategy, kv_group_size=cfg.kv.group_size,
                        stage_every=cfg.dispatch.stage_every, stable_attention=cfg.dispatch.stable_attention,
                        small_m_gemm=cfg.dispatch.small_m_gemm)
        if eng.external:
            eng.tokenizer = tokenizer  # reference APIs take one (for stop tokens); ids still go in and out
        if eng.execution == "static":
            fuse = cfg.dispatch.fuse_rounds
            eng.fuse = dispatch_defaults()["fuse_rounds"] if fuse is None else fuse
        return eng

    try:
        method = engine(cfg.method.name)
    except DrafterError as e:
        raise ConfigError(f"{e} (method.drafter={cfg.method.drafter})") from None
    block = method.block  # declared by every engine (engines/base.py)
    ref_name, ref_execution = arm_of(cfg.reference, cfg.execution)
    reference = also = None
    try:
        same = (method.name, cfg.execution) == (ref_name, ref_execution)
        reference = None if same else engine(cfg.reference)
        also = engine(cfg.also_against) if cfg.also_against else None
    except BaseException:
        for started in (method, reference):
            if started is not None:
                started.close()  # an outside engine already started stops here
        raise
    return Arms(method, reference, block, reference_is_base=ref_name == "base", rollback_auto=auto, also=also)


def _method_cfg(cfg, name: str):
    """cfg.method with the drafter resolved to a directory (engines take paths, not fixture names)."""
    engine = get_engine(name)
    if "drafter" not in engine.knobs:
        return cfg.method
    resolved = OmegaConf.to_container(cfg.method, resolve=True)
    resolved.update(name=engine.name, drafter=resolve_drafter(cfg, engine.drafter_kind))
    return OmegaConf.create(resolved)


def _check_supported(model, cfg, env: dict) -> None:
    if env["backend"] == "cpu" and cfg.arch.dtype not in ("float32", "native") and has_moe(model):
        raise Unsupported(f"MoE experts (GatherMM) run only in float32 on the mlx CPU backend; "
                          f"arch.dtype={cfg.arch.dtype} needs a GPU (or use arch.dtype=float32)")
    shared = getattr(getattr(text_model(model), "args", None), "num_kv_shared_layers", 0) or 0
    if cfg.kv.name in ("q8", "q4") and shared > 0:
        raise Unsupported(f"mlx-lm cannot quantize the KV cache of a model whose last {shared} layers share "
                          "KV with earlier ones (they receive packed tuples); use kv=native/float16/bfloat16")


def _known_unsupported(e: Exception) -> str | None:
    msg = str(e)
    if "[quantize] The last dimension" in msg:
        return f"KV quantization group does not divide the head dim ({msg.split('.')[0]}); try kv.group_size=32"
    if "only supports float32" in msg:
        return f"this op runs only in float32 on this backend: {msg}"
    if "[quantized_matmul] No implementation" in msg:
        return f"this backend has no quantized KV attention kernel for these shapes/dtype ({msg.split(',')[0]})"
    return None


def _headline(rec: dict) -> str:
    if rec["status"] != "ok":
        return rec.get("reason", "")
    s = rec["summary"]
    tau = f"{s['tau']:.2f}" if s["tau"] is not None else "-"
    ref = rec["cell"].get("reference") or "base"
    model = (s.get("model") or {}).get("predicted_speedup")
    predicted = f" (model {model:.3f}x)" if model is not None and ref == "base" else ""
    also = s.get("also")
    versus = f"; vs {also['against']} {also['speedup']:.3f}x ({also['decode_tps']:.1f} tok/s)" if also else ""
    return (f"{s['decode_tps']:.1f} tok/s, {ref} {s['base_decode_tps']:.1f} tok/s, speedup {s['speedup']:.3f}x"
            f"{predicted}{versus}, tau {tau}, diverged {s['diverged_prompts']}/{s['prompts']}"
            f"{' (forced: expected)' if rec.get('forced') else ''}")
