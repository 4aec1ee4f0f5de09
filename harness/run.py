"""One cell, end to end: validate, skip if already recorded, measure, write the record.

Bad input raises ConfigError before anything is written. Once the input is valid
every outcome is recorded: `ok`, `unsupported` (this method/model/backend
combination cannot run, with the reason) or `error` (with the exception), and a
sweep goes on to the next cell.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
import time
import traceback
from pathlib import Path

from omegaconf import OmegaConf

from engines.base import DrafterError, Unsupported, get_engine
from engines.target import Target
from harness.config import ConfigError, resolve_drafter, validate
from harness.env import STREAM_PROBE, LoadMeter, blas_warning, environment, stream_rate
from harness.measure import Arms, measure_cell
from harness.gguf_import import conversion_record
from harness.models import has_moe, load_target, model_dtype, resolve_model, weight_bytes
from harness.progress import PROGRESS
from harness.prompts import load_suite, suite_sources
from harness.records import SCHEMA_VERSION, canonical_cell, cell_id, claim_cell, device_lock, read_record, write_record

def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_cell(cfg) -> Path | None:
    """Measure the cell `cfg` names and write its record; returns the record path."""
    validate(cfg)
    ckpt = resolve_model(cfg.arch.model, cfg.arch.dtype, cfg.arch.gguf_dequantize, log)
    prompts = load_suite(cfg.bench.suite, list(cfg.bench.categories), cfg.bench.max_prompts, cfg.bench.per_category)
    cell = canonical_cell(cfg)
    cid = cell_id(cell)
    path = Path(cfg.out_dir) / f"{cid}.json"
    head = PROGRESS.begin_job()
    if not claim_cell(cid, cfg.out_dir):
        log(f"{head} skip {cid}: same cell as an earlier job ({cfg.method.name} ignores the axis that differs)")
        return path
    old = read_record(path)
    if old and old.get("status") == "ok" and not cfg.force:
        log(f"{head} skip {cid}: already recorded in {path} (force=true re-runs it)")
        return path
    turns = sum(len(p.turns) for p in prompts)
    log(f"{head} {cid}: {len(prompts)} prompts ({turns} turns), {cfg.bench.max_new_tokens} new tokens each")
    if warning := blas_warning(environment()):  # None unless the reference BLAS serves CPU matmuls
        log(warning)
    t0 = time.perf_counter()
    with device_lock(cfg.allow_shared_device) as waited:
        started = time.time()
        record = _measure(cfg, cell, cid, prompts, ckpt)
        record["device"] = {"held_from": started, "held_to": time.time(), "waited_s": round(waited(), 3),
                            "shared": bool(cfg.allow_shared_device)}
    if os.environ.get("SPEC_HARNESS_TEST_KILL") and os.environ["SPEC_HARNESS_TEST_KILL"] in cid:
        os._exit(137)  # test hook: a job killed after measuring, before its record exists
    write_record(path, record)
    PROGRESS.measured_cell(cfg.method.name, time.perf_counter() - t0)
    log(f"  -> {record['status']}: {_headline(record)}  [{path}]")
    return path


def _measure(cfg, cell: dict, cid: str, prompts, ckpt: Path) -> dict:
    record = {"schema": SCHEMA_VERSION, "cell_id": cid, "cell": cell,
              "config": OmegaConf.to_container(cfg, resolve=True), "env": environment(),
              "suite": suite_sources(cfg.bench.suite),  # the prompt files read: path, sha256, package version
              "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    t0 = time.perf_counter()
    try:
        for name in (cfg.method.name, cfg.reference):
            _method_cfg(cfg, name)  # a drafter that does not exist is unsupported before the model loads
        model, tokenizer = load_target(ckpt, cfg.arch.dtype)
        record["model"] = {"path": str(ckpt), "model_type": getattr(model, "model_type", None),
                           "dtype": model_dtype(model), "quantization": _quantization(ckpt),
                           "gguf": conversion_record(ckpt)}
        _check_supported(model, cfg, record["env"])
        record["ceiling"] = decode_ceiling(model)
        arms = _build_arms(model, tokenizer, cfg)
        record["cache"] = vars(arms.method.target.layout)
        started = time.perf_counter()
        progress = lambda done, total: log(f"  turn {done}/{total}  {time.perf_counter() - started:.1f}s")
        with LoadMeter() as load:
            record.update(measure_cell(arms, tokenizer, prompts, cfg.bench, progress))
        record["load"] = load.record
        record["engine"] = arms.method.describe()  # after measuring: rollback=auto has picked its strategy
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
    record["wall_s"] = round(time.perf_counter() - t0, 3)
    return record


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


def _build_arms(model, tokenizer, cfg) -> Arms:
    auto = cfg.rollback == "auto"
    strategy = "capture" if auto else cfg.rollback  # auto: switched to the measured fastest before timing

    def engine(name, method_cfg):
        target = Target(model, kv=cfg.kv.name, rollback=strategy, kv_group_size=cfg.kv.group_size,
                        stage_every=cfg.dispatch.stage_every, stable_attention=cfg.dispatch.stable_attention,
                        small_m_gemm=cfg.dispatch.small_m_gemm)
        eng = get_engine(name)(target, method_cfg)
        if eng.external:
            eng.tokenizer = tokenizer  # reference APIs take one (for stop tokens); ids still go in and out
        return eng

    try:
        method = engine(cfg.method.name, _method_cfg(cfg, cfg.method.name))
    except DrafterError as e:
        raise ConfigError(f"{e} (method.drafter={cfg.method.drafter})") from None
    block = getattr(method, "block", None) or (cfg.method.block_size if "block_size" in method.knobs else 1)
    ref_name = get_engine(cfg.reference).name
    reference = None if method.name == ref_name else engine(cfg.reference, _method_cfg(cfg, cfg.reference))
    return Arms(method, reference, block, reference_is_base=ref_name == "base", rollback_auto=auto)


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
    from engines.hidden import text_model

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
    return (f"{s['decode_tps']:.1f} tok/s, {ref} {s['base_decode_tps']:.1f} tok/s, speedup {s['speedup']:.3f}x"
            f"{predicted}, tau {tau}, diverged {s['diverged_prompts']}/{s['prompts']}")
