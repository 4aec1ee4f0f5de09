"""Run records: one JSON file per cell, written atomically.

A cell (harness/config.canonical_cell) is the resolved config with the axes its method
ignores normalised away (base has no block size and never rolls back), so equal cells get
equal ids: a sweep runs each distinct cell once, and a re-run skips cells already recorded.
This module reads and writes records without the config or the engines: the report imports
it, and reads only records.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import stat
import tempfile
from pathlib import Path

SCHEMA_VERSION = 1
# A record's load.other_cpu_share above this (other processes busy on more than a fifth of the machine)
# makes its tok/s and ratios suspect: the report's conditions line and the gate's verdicts say so.
LOAD_WARN = 0.2


def cell_id(cell: dict) -> str:
    digest = hashlib.sha256(json.dumps(cell, sort_keys=True).encode()).hexdigest()[:10]
    m = cell["method"]
    bs = f"-bs{m['block_size']}" if m.get("block_size") else ""
    ref = f"__vs-{str(cell['reference']).replace(':', '-')}" if cell.get("reference") not in (None, "base") else ""
    ex = f"__{cell['execution']}" if cell.get("execution") not in (None, "eager") else ""
    force = m.get("force") or {}
    ex += (f"__forced-n{force['accepted']}" if "accepted" in force else f"__forced-p{force['rate']:g}") if force else ""
    return f"{cell['arch']['name']}__{m['name']}{bs}__kv-{cell['kv']['name']}{ex}{ref}__{digest}"


def write_record(path: Path, record: dict) -> None:
    """Write `record` to `path` so that readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.stem}.*.tmp"):  # left by a run killed mid-write
        stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would surprise whoever shares the results
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, default=_json_default)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def multirun_id() -> int | None:
    """The running multirun's identity (the mtime of the multirun.yaml Hydra writes when the
    sweep starts), the same in every job of it, in any process or host; None outside one.
    A record carries it, so a later job of the same cell (a method that ignores the axis the
    jobs differ in) sees the cell already done in this sweep, while a resumed sweep (a new
    multirun) re-runs what is missing."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return None
        return (Path(hc.sweep.dir) / "multirun.yaml").stat().st_mtime_ns
    except (ValueError, OSError):  # no Hydra context (gates compose their cells) or no sweep file
        return None


def _json_default(x):
    if hasattr(x, "item"):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def read_record(path: Path) -> dict | None:
    """The record at `path`, or None where there is none (or it cannot be read as one)."""
    return record_problem(path)[0]


def record_problem(path: Path) -> tuple[dict | None, str | None]:
    """(the record at `path`, None) or (None, why it is not one: not a regular file, unreadable,
    not JSON, not a record, a record without a field the report reads, or with one of the wrong
    type). Only a regular file is opened: a FIFO named *.json would block the reader forever."""
    try:
        rec = json.loads(_read_regular(Path(path)))
    except _NotRegular as e:
        return None, f"is {e}, not a regular file: never opened"
    except OSError as e:
        return None, f"cannot be read ({e.strerror or e})"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return None, f"is not valid JSON ({getattr(e, 'msg', e)}; a copy cut short, or edited by hand)"
    except RecursionError:
        return None, "is not valid JSON (nested too deep to read)"
    if not isinstance(rec, dict) or "cell" not in rec or "schema" not in rec:
        return None, "is not a harness record (no schema / cell)"
    if rec["schema"] != SCHEMA_VERSION:
        return None, f"is a record of schema {repr(rec['schema'])[:40]}; this harness reads schema {SCHEMA_VERSION}"
    missing = _missing_keys(rec)
    if missing:
        return None, f"is a record without {', '.join(missing)} (cut or edited by hand)"
    wrong = wrong_type(rec)
    if wrong:
        return None, f"is a record whose {wrong} (damaged or edited by hand)"
    return rec, None


class _NotRegular(Exception):
    """A path that is no regular file; the message names what it is (a FIFO, a directory)."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _read_regular(path: Path) -> str:
    """The text of `path` if it is a regular file (symbolic links followed); else _NotRegular.
    Checked before opening (opening a tape device can rewind it) and again on the open file,
    opened non-blocking, in case a FIFO took the file's place in between."""
    _check_regular(os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        _check_regular(os.fstat(fd).st_mode)
        return f.read().decode()


def _check_regular(mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise _NotRegular(next((name for test, name in _KINDS if test(mode)), "a special file"))


# What every record holds, and what an ok one adds: the report reads these without asking.
RECORD_KEYS = ("cell_id", "status", "config", "env")
CELL_KEYS = ("arch", "method", "kv", "bench")
SUMMARY_KEYS = ("decode_tps", "base_decode_tps", "speedup", "tau", "prompts", "diverged_prompts")
# What each per-prompt item of an ok record holds (the report's per-category numbers sum these),
# and its per-round columns and reference arm where it has them.
PROMPT_KEYS = ("id", "category", "n_tokens", "decode_s", "decode_tps", "rounds", "drafted", "accepted",
               "accept_hist", "proposed_at", "accepted_at")
PART_KEYS = {"rounds_detail": ("drafted", "accepted"), "base": ("decode_s", "decode_tps")}


def _missing_keys(rec: dict) -> list[str]:
    missing = [k for k in RECORD_KEYS if k not in rec]
    cell = _dict(rec.get("cell"))
    missing += [f"cell.{k}" for k in CELL_KEYS if k not in cell]
    missing += [f"cell.{k}.name" for k in ("arch", "method", "kv") if isinstance(cell.get(k), dict)
                and "name" not in cell[k]]
    if rec.get("status") == "ok":
        missing += [f"summary.{k}" for k in SUMMARY_KEYS if k not in _dict(rec.get("summary"))]
        missing += _missing_in_prompts(rec.get("prompts"))[:3]  # the first few name the damage well enough
    return missing


def _missing_in_prompts(items) -> list[str]:
    missing = []
    for n, item in enumerate(items if isinstance(items, list) else []):
        item = _dict(item)
        missing += [f"prompts[{n}].{k}" for k in PROMPT_KEYS if k not in item]
        for part, keys in PART_KEYS.items():
            if isinstance(item.get(part), dict):
                missing += [f"prompts[{n}].{part}.{k}" for k in keys if k not in item[part]]
    return missing


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


# The type of every field the report reads (where present): a kind, a {key: node} dict, or a
# [node] list of them. Null stands for absent only where `maybe` says so; keys not named here
# are not read (the CSVs copy scalars as they are).
class _Kind:
    def __init__(self, name: str, fits, nullable: bool = False):
        self.name, self.fits, self.nullable = name, fits, nullable


_INT64 = 2 ** 63  # past this pandas keeps numbers as Python objects, and sums of them overflow


def _is_int(v) -> bool:
    return type(v) is int and -_INT64 < v < _INT64  # bool is an int subclass, and no count


def _is_number(v) -> bool:  # NaN reads as "-" (a missing value); infinity breaks every plot axis
    return _is_int(v) or (type(v) is float and not math.isinf(v))


TEXT, INT, NUMBER = _Kind("a string", lambda v: type(v) is str), _Kind("an integer", _is_int), \
    _Kind("a number", _is_number)
ANY = _Kind("anything", lambda v: True, nullable=True)


def maybe(node):
    """`node`, or null where the report reads null as absent."""
    return _Kind(node.name, node.fits, nullable=True) if isinstance(node, _Kind) else ("maybe", node)


NUMBERS = [NUMBER]
ROUNDS = maybe({"drafted": [INT], "accepted": [INT], "emitted": [INT], "position": [INT],
                "phase_ms": maybe({"*": NUMBERS}), "phase_host_ms": maybe({"*": NUMBERS})})
ARM = {"decode_s": NUMBERS, "decode_tps": NUMBERS}
PROMPT = {"id": TEXT, "category": TEXT, "suite": maybe(TEXT), "turn": maybe(INT), "n_tokens": INT,
          **ARM, "base": maybe(ARM), "rounds": INT, "drafted": INT, "accepted": INT, "accept_hist": [INT],
          "proposed_at": [INT], "accepted_at": [INT], "first_divergence": maybe(INT),
          "matched_fraction": maybe(NUMBER), "context_tokens": maybe(NUMBER),
          "divergence": maybe({"reference_margin": maybe(NUMBER), "method_token_rank": maybe(NUMBER)}),
          "first_token": maybe({"prefill": NUMBER, "prepare": NUMBER}), "rounds_detail": ROUNDS}
SUMMARY_NUMBERS = ("decode_tps", "base_decode_tps", "speedup", "speedup_ci_low", "speedup_ci_high",
                   "speedup_prompts", "speedup_prompts_ci_low", "speedup_prompts_ci_high", "e2e_speedup",
                   "e2e_speedup_ci_low", "e2e_speedup_ci_high", "base_ttft_ms", "ttft_ms", "base_e2e_tps", "e2e_tps",
                   "ratio_of_medians", "base_sigma_pct", "decode_sigma_pct", "tau", "acceptance_rate",
                   "matched_fraction", "peak_memory_bytes", "base_peak_memory_bytes", "cache_bytes",
                   "base_cache_bytes", "round_ms_median", "base_round_ms_median")
MODEL_NUMBERS = ("predicted_speedup", "break_even_acceptance", "verify_cost_ratio", "round_cost_ratio",
                 "iid_acceptance", "base_pipelining_gain")
SUMMARY = maybe({**{k: maybe(NUMBER) for k in SUMMARY_NUMBERS},
                 **{k: maybe(INT) for k in ("prompts", "diverged_prompts", "earliest_divergence", "outlier_reps")},
                 "per_position_acceptance": maybe([maybe(NUMBER)]), "speedup_reps": maybe([ANY]),
                 "model": maybe({k: maybe(NUMBER) for k in MODEL_NUMBERS})})
ENGINE = maybe({"version": maybe(TEXT), "launch": maybe(TEXT), "command": maybe(TEXT)})
REPORTED = {
    "cell_id": TEXT, "status": TEXT, "started_at": maybe(TEXT),
    "cell": {"arch": {"name": TEXT}, "method": {"name": TEXT, "label": maybe(TEXT), "block_size": maybe(INT),
                                                "options": maybe({})},
             "kv": {"name": TEXT}, "reference": maybe(TEXT), "dispatch": maybe({}),
             "bench": maybe({"temperature": maybe(NUMBER), "context": maybe(INT), "max_new_tokens": maybe(NUMBER)})},
    "env": {"host": maybe(TEXT), "backend": maybe(TEXT), "blas_kind": maybe(TEXT),
            "git": maybe({"sha": maybe(TEXT)}), "blas_selection": maybe({"action": maybe(TEXT), "reason": maybe(TEXT)})},
    "model": maybe({"path": maybe(TEXT), "dtype": maybe(TEXT), "model_type": maybe(TEXT), "quantization": maybe({})}),
    "ceiling": maybe({"weight_bytes": maybe(NUMBER), "stream_gbs": maybe(NUMBER), "tps": maybe(NUMBER)}),
    "load": maybe({"other_cpu_share": maybe(NUMBER)}), "engine": ENGINE, "reference_engine": ENGINE,
    "suite": maybe([{"path": TEXT, "sha256": TEXT}]), "context": maybe({}), "summary": SUMMARY,
    "prompts": maybe([PROMPT]),
}


def wrong_type(rec: dict) -> str | None:
    """The first field the report reads whose value has the wrong type, said as
    "summary.speedup is a str, not a number"; or where per-round columns of one prompt differ
    in length; None when every one fits `REPORTED`."""
    return _wrong(rec, REPORTED, "") or _ragged_rounds(rec)


def _wrong(value, node, where: str) -> str | None:
    if isinstance(node, tuple):  # maybe(dict or list)
        return None if value is None else _wrong(value, node[1], where)
    if isinstance(node, _Kind):
        if value is None and node.nullable or node.fits(value):
            return None
        return f"{where} is {_shown(value)}, not {node.name}"
    if isinstance(node, dict):
        if type(value) is not dict:
            return f"{where} is {_shown(value)}, not an object"
        every = node.get("*")
        for key, sub in (((k, every) for k in value) if every is not None else node.items()):
            if key in value:
                why = _wrong(value[key], sub, f"{where}.{key}" if where else key)
                if why:
                    return why
        return None
    if type(value) is not list:
        return f"{where} is {_shown(value)}, not a list"
    (sub,) = node
    if isinstance(sub, _Kind) and _fits_at_c_speed(value, sub):
        return None  # a long per-round column: the loop below only to name the culprit
    for n, item in enumerate(value):
        why = _wrong(item, sub, f"{where}[{n}]")
        if why:
            return why
    return None


def _fits_at_c_speed(values: list, kind: _Kind) -> bool:
    # True where every item is an int in range (INT, NUMBER) or a float not infinite (NUMBER).
    types = set(map(type, values))
    if not values or kind.fits is ANY.fits:
        return True
    if types == {int} and kind.fits in (_is_int, _is_number):
        return -_INT64 < min(values) and max(values) < _INT64
    return types == {float} and kind.fits is _is_number and not any(map(math.isinf, values))


def _ragged_rounds(rec: dict) -> str | None:
    # The report zips a prompt's per-round columns (and each arm's per-rep ones): equal lengths or none.
    for n, item in enumerate(rec.get("prompts") or []):
        detail = item.get("rounds_detail") or {}
        lengths = {k: len(detail[k]) for k in ("drafted", "accepted", "emitted", "position") if k in detail}
        if len(set(lengths.values())) > 1:
            return f"prompts[{n}].rounds_detail columns differ in length ({_lengths(lengths)})"
        reps = {k: len(item[k]) for k in ("decode_s", "decode_tps") if k in item}
        if item.get("base"):
            reps.update({f"base.{k}": len(item["base"][k]) for k in ("decode_s", "decode_tps") if k in item["base"]})
        if len(set(reps.values())) > 1:
            return f"prompts[{n}] per-rep columns differ in length ({_lengths(reps)})"
    return None


def _lengths(lengths: dict) -> str:
    return ", ".join(f"{k} {n}" for k, n in lengths.items())


def _shown(value) -> str:
    """A value named by its type (what JSON made of it), short: 'a str', 'null', 'nan', 'an int of 400 digits'."""
    if value is None:
        return "null"
    if type(value) is float and (math.isnan(value) or math.isinf(value)):
        return repr(value)
    if type(value) is int and not _is_int(value):
        return f"an int of {len(str(abs(value)))} digits"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def scan_records(root: Path) -> tuple[list[tuple[Path, dict]], list[tuple[Path, str]]]:
    """([(path, record)], [(path, why unreadable)]) for every *.json under root, hidden paths
    (temp files, launcher folders, the report's staging) aside: a broken record is named, never
    silently dropped. Only regular files are opened."""
    good, bad, seen = [], [], {}
    gc_was_on = gc.isenabled()
    gc.disable()  # thousands of parsed records: the cyclic collector would rescan them all after every file
    try:
        for path in sorted(Path(root).rglob("*.json")):
            if any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            rec, why = record_problem(path)
            if rec is None:
                bad.append((path, why))
            elif rec["cell_id"] in seen:  # results of several hosts copied together: one cell, one row
                first_path, first = seen[rec["cell_id"]]
                if rec == first:
                    bad.append((path, f"is a copy of {first_path}"))
                    continue
                older, newer = sorted([(first_path, first), (path, rec)], key=lambda pr: pr[1].get("started_at") or "")
                bad.append((older[0], f"measures the same cell as {newer[0]}, which is newer and is reported"))
                good = [(p, r) for p, r in good if p != first_path] + [newer]
                seen[rec["cell_id"]] = newer
            else:
                good.append((path, rec))
                seen[rec["cell_id"]] = (path, rec)
    finally:
        if gc_was_on:
            gc.enable()
    return good, bad


def iter_records(root: Path):
    """(path, record) for every readable record under root (scan_records names the rest)."""
    yield from scan_records(root)[0]
