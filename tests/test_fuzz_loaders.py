"""A seeded, time-bounded fuzz of the checkpoint loaders.

Hundreds of damaged checkpoints, each built from a fixture by one mutation that makes it
invalid whatever the loader's implementation: a read config.json field given a wrong type,
an out-of-range or absurd size, a required field deleted, an unknown field added (drafters:
mlx-lm drops unknown target fields by design), config.json cut short or not UTF-8, a
safetensors file truncated or its header damaged (length, bytes, a tensor's shape, dtype
width, offsets or name). Each goes through the loader a run uses (load_drafter, load_eagle3,
load_mtp, load_target) and must end within seconds in the harness's own error type
(DrafterError; TargetError for targets, which run.py records as an `error` cell) with a
one-line message naming the file (the checkpoint directory where the tensors as a whole do
not fit) -- never a raw exception, a hang, or a load that succeeds.

Not generated, because no loader can see them: a dtype relabelled to another of the same
width (bf16 <-> f16), and header metadata edits.
"""

import json
import random
import signal
import struct
import time
from pathlib import Path

import pytest

from engines.drafters.dflash import DFlashConfig, load_drafter
from engines.drafters.eagle3 import LAYER_KEYS, load_eagle3
from engines.drafters.mtp import load_mtp
from engines.errors import DrafterError
from harness.errors import TargetError
from harness.models import fixtures
from harness.models.load import load_target

SEED = 20260521
CASES = {"dflash": 200, "eagle3": 200, "target": 200, "mtp": 60}  # 660 in all
CASE_LIMIT_S = 5.0

ABSURD = [0, -1, -7, 2 ** 31, 2 ** 40, 10 ** 15, 2 ** 63 - 1, 2 ** 64]
WRONG = {  # for a field holding this JSON kind: values no loader may accept
    "int": ["eight", "", [1], {"a": 1}, True, False, 1.5, float("nan"), *ABSURD],
    "id": ["eight", [1], {"a": 1}, True, 1.5, float("nan"), -1, 2 ** 40, 2 ** 64],  # token ids: 0 is one
    "float": ["x", [], {}, True, -1.0, 0, -0.5, float("nan"), float("inf"), float("-inf"), -(10 ** 400)],
    "bool": ["yes", 1, 0, [], {}, "true"],
    "list": ["x", 5, {}, ["a"], [-3], [10 ** 12], [1.5], [None]],
    "dict": [[], "x", 5, True],
    "str": [5, [], {}, True, 1.5],
}
# Fields each layout's loader reads, as (path, kind); fixtures hold every one of them.
READ = {
    "dflash": [((k,), "int") for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                       "head_dim", "intermediate_size", "max_position_embeddings", "block_size",
                                       "num_target_layers", "vocab_size")]
    + [(("rms_norm_eps",), "float"), (("rope_theta",), "float"), (("dflash_config",), "dict"),
       (("dflash_config", "target_layer_ids"), "list"), (("dflash_config", "mask_token_id"), "id")],
    "eagle3": [(("transformer_layer_config", k), "int") for k in ("hidden_size", "num_attention_heads",
                                                                 "num_key_value_heads", "head_dim",
                                                                 "intermediate_size", "max_position_embeddings",
                                                                 "vocab_size")]
    + [(("transformer_layer_config", "rms_norm_eps"), "float"), (("transformer_layer_config", "rope_theta"), "float"),
       (("transformer_layer_config", "model_type"), "str"), (("transformer_layer_config",), "dict"),
       (("draft_vocab_size",), "int"), (("target_hidden_size",), "int"), (("norm_before_residual",), "bool"),
       (("eagle_aux_hidden_state_layer_ids",), "list"), (("speculators_model_type",), "str")],
    "target": [((k,), "int") for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim",
                                       "max_position_embeddings")]
    + [(("rms_norm_eps",), "float"), (("rope_theta",), "float"), (("tie_word_embeddings",), "bool")],
}
# Fields without which the model is undefined (deleting one must be refused).
REQUIRED = {"dflash": [(k,) for k in DFlashConfig.REQUIRED] + [("dflash_config",), ("dflash_config", "target_layer_ids"),
                                                               ("dflash_config", "mask_token_id")],
            "eagle3": [("transformer_layer_config", k) for k in LAYER_KEYS] + [("transformer_layer_config",)],
            "target": [(k,) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                      "vocab_size", "rms_norm_eps", "model_type")]}
# str fields: a wrong type is refused, but null may mean "the default"; everything else: null is wrong too
NULL_IS_WRONG = {"dflash": [(k,) for k in DFlashConfig.REQUIRED], "eagle3": REQUIRED["eagle3"],
                 "target": [(k,) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta")]}


# ---------------------------------------------------------------- mutations

def _get(cfg, path):
    for k in path:
        cfg = cfg[k]
    return cfg


def _set(cfg, path, value):
    _get(cfg, path[:-1])[path[-1]] = value


def _config_mutation(rng: random.Random, layout: str, text: str) -> tuple[str, bytes, bool]:
    """(what, the new config.json, whether the message must name config.json itself: all but a
    target field only mlx-lm's model requires, whose refusal names the checkpoint)."""
    what, raw = _config_edit(rng, layout, json.loads(text))
    return what, raw, not (layout == "target" and what.startswith("no ") and what != "no model_type")


def _config_edit(rng: random.Random, layout: str, cfg: dict) -> tuple[str, bytes]:
    op = rng.choice(["wrong", "wrong", "wrong", "missing", "extra", "null", "text"]
                    if layout != "target" else ["wrong", "wrong", "wrong", "missing", "null", "text"])
    if op == "wrong":
        path, kind = rng.choice(READ[layout])
        value = rng.choice(WRONG[kind])
        _set(cfg, path, value)
        return f"{'.'.join(path)} = {json.dumps(value)[:40]}", json.dumps(cfg).encode()
    if op == "null":
        path = rng.choice(NULL_IS_WRONG[layout])
        _set(cfg, path, None)
        return f"{'.'.join(path)} = null", json.dumps(cfg).encode()
    if op == "missing":
        path = rng.choice(REQUIRED[layout])
        del _get(cfg, path[:-1])[path[-1]]
        return f"no {'.'.join(path)}", json.dumps(cfg).encode()
    if op == "extra":
        section = rng.choice([()] + [p for p, kind in READ[layout] if kind == "dict"])
        name = f"zz_fuzz_{rng.randrange(10 ** 6)}"
        _get(cfg, section)[name] = rng.choice([1, "x", None, [], {"a": 1}, True])
        return f"extra {'.'.join(section + (name,))}", json.dumps(cfg).encode()
    raw = json.dumps(cfg).encode()
    how = rng.choice(["cut", "cut", "binary", "array", "empty", "digits", "deep"])
    if how == "digits":  # an integer literal past Python's limit on digits
        return "config.json with a 5000-digit number", raw[:-1] + b', "zz": ' + b"9" * 5000 + b"}"
    if how == "deep":
        return "config.json nested 100000 deep", raw[:-1] + b', "zz": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    if how == "cut":
        at = rng.randrange(len(raw) - 1)
        return f"config.json cut at {at}", raw[:at]
    if how == "binary":
        at = rng.randrange(len(raw))
        return f"config.json with bytes ff fe at {at}", raw[:at] + b"\xff\xfe" + raw[at:]
    if how == "array":
        return "config.json holds an array", b"[" + raw + b"]"
    return "config.json empty", b""


_WIDTH = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
          "I8": 1, "U8": 1, "BOOL": 1}


def _structural(text: bytes) -> list[int]:
    """Offsets of the JSON punctuation outside strings."""
    out, quoted, escaped = [], False, False
    for i, c in enumerate(text.decode()):
        if quoted:
            quoted, escaped = (c != '"' or escaped), (c == "\\" and not escaped)
        elif c == '"':
            quoted = True
        elif c in "{}[]:,":
            out.append(i)
    return out


def _header(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _pack(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _weights_mutation(rng: random.Random, raw: bytes, names) -> tuple[str, bytes]:
    """One damage to a safetensors file; `names`: the tensors the loader reads (semantic edits hit one of them)."""
    header, data = _header(raw)
    n = len(raw) - len(data) - 8
    op = rng.choice(["truncate", "length", "garbage", "shape", "shape", "dtype", "offsets", "rename", "drop"])
    if op == "truncate":
        at = rng.randrange(len(raw) - 1)
        return f"cut at byte {at}", raw[:at]
    if op == "length":  # n - 1 cuts the closing brace (mx.save_safetensors writes no padding after it)
        assert raw[8 + n - 1:8 + n] == b"}"
        length = rng.choice([0, 1, n - 1, len(raw), 2 ** 40, 2 ** 64 - 1])
        return f"header length {length}", struct.pack("<Q", length) + raw[8:]
    if op == "garbage":  # '#' in place of a brace, bracket, colon or comma: never JSON
        at = 8 + rng.choice(_structural(raw[8:8 + n]))
        return f"header byte {at} garbage", raw[:at] + b"#" + raw[at + 1:]
    if op == "drop":  # t2d is unused (d2t maps), so a checkpoint without it is whole
        names = [k for k in names if k != "t2d"]
    name = rng.choice(sorted(names))
    t = header[name]
    if op == "shape":
        shape = t["shape"]
        new = shape[::-1] if len(shape) > 1 and shape[0] != shape[-1] else [shape[0] + 1] + shape[1:]
        t["shape"] = new
        return f"{name} shape {shape} -> {new}", _pack(header, data)
    if op == "dtype":
        other = rng.choice([d for d, w in _WIDTH.items() if w != _WIDTH[t["dtype"]]])
        t["dtype"], old = other, t["dtype"]
        return f"{name} dtype {old} -> {other}", _pack(header, data)
    if op == "offsets":
        a, b = t["data_offsets"]
        t["data_offsets"] = rng.choice([[a, b + 2], [b, a], [a, len(data) + 64], [a + 1, b]])
        return f"{name} offsets -> {t['data_offsets']}", _pack(header, data)
    if op == "rename":
        header[f"zzfuzz_{name}"] = header.pop(name)
        return f"{name} renamed", _pack(header, data)
    del header[name]
    return f"{name} dropped", _pack(header, data)


# ---------------------------------------------------------------- the run

@pytest.fixture(scope="module")
def sources():
    """Each layout's files as bytes, and the tensors its loader reads."""
    import mlx.core as mx

    out = {}
    for layout, src in (("dflash", fixtures.drafter_dir("dflash", "llama")), ("eagle3", fixtures.drafter_dir("eagle3", "llama")),
                        ("target", fixtures.fixture_dir("llama")), ("mtp", fixtures.fixture_dir("qwen35"))):
        files = {f.name: f.read_bytes() for f in sorted(src.iterdir()) if f.is_file()}
        names = list(mx.load(str(src / "model.safetensors")))
        out[layout] = (files, [k for k in names if k.startswith("mtp.")] if layout == "mtp" else names)
    return out


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def _case(rng, layout, sources, root: Path, i: int):
    files, names = sources[layout]
    files = dict(files)
    if layout != "mtp" and rng.random() < 0.6:
        what, files["config.json"], exact = _config_mutation(rng, layout, files["config.json"].decode())
        named = root / "config.json" if exact else root
    else:
        what, files["model.safetensors"] = _weights_mutation(rng, files["model.safetensors"], names)
        # a damaged header is named by file; tensors that do not fit, by checkpoint
        named = root / "model.safetensors" if what.startswith(("cut at", "header")) else root
    root.mkdir(parents=True)
    for name, raw in files.items():
        (root / name).write_bytes(raw)
    return what, named


def test_damaged_checkpoints_end_in_the_harness_error_naming_the_file_within_seconds(models, sources, tmp_path):
    rng = random.Random(SEED)
    load = {"dflash": lambda p: load_drafter(p, models["llama"][0]), "eagle3": lambda p: load_eagle3(p, models["llama"][0]),
            "target": lambda p: load_target(p, "float32"), "mtp": lambda p: load_mtp(p, models["qwen35"][0])}
    error = {"dflash": DrafterError, "eagle3": DrafterError, "target": TargetError, "mtp": DrafterError}
    order = [layout for layout, n in CASES.items() for _ in range(n)]
    rng.shuffle(order)
    slowest, started = 0.0, time.perf_counter()
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i, layout in enumerate(order):
            root = tmp_path / f"{i:03d}-{layout}"
            what, named = _case(rng, layout, sources, root, i)
            case = f"case {i} ({layout}: {what}; seed {SEED})"
            t0 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, 4 * CASE_LIMIT_S)
            try:
                load[layout](root)
            except error[layout] as e:
                msg = str(e)
            except _Hang:
                pytest.fail(f"{case} hung")
            except Exception as e:  # noqa: BLE001 -- a raw exception is the failure this test looks for
                pytest.fail(f"{case} raised {type(e).__name__}: {e}")
            else:
                pytest.fail(f"{case} loaded: a damaged checkpoint was accepted")
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            took = time.perf_counter() - t0
            slowest = max(slowest, took)
            assert took < CASE_LIMIT_S, f"{case} took {took:.1f}s"
            assert "\n" not in msg, f"{case}: {msg!r}"
            assert str(named) in msg, f"{case}: the message does not name {named}: {msg}"
    finally:
        signal.signal(signal.SIGALRM, previous)
    print(f"{len(order)} damaged checkpoints refused in {time.perf_counter() - started:.1f}s "
          f"(slowest {slowest:.2f}s)")
