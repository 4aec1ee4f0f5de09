"""Self-distilled data as one compressed file, so data a GPU made trains on any machine.

`python -m train.pack CACHE FILE.npz` packs a data cache (train/data.py's layout): every
shard's prompt and answer ids, the prompts' text (the contamination check reads it) and the
manifest. `python -m train.pack --unpack FILE.npz CACHE` writes the same cache back, shard
for shard, so `python -m train ... data.cache_dir=CACHE` trains on it without
generating anything (its manifest must match the run's settings, as for any cache). Ids are
stored as the narrowest unsigned integer that holds the vocabulary, in one flat array with
offsets; the unpacked shards are byte-identical to the packed ones. A cache packed before
shards became data.batch prompts each (its manifest names a shard_size) is re-cut into that
layout as it is unpacked: the same rows in the same order, so the trainer finds every shard.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from harness.errors import ConfigError

FORMAT = "spec-harness-data/1"


def pack(cache: Path, dest: Path) -> dict:
    """Write `cache` to `dest` (.npz); returns {shards, rows, tokens, bytes}."""
    cache, dest = Path(cache), Path(dest)
    shards = sorted(cache.glob("shard-*.jsonl"))
    if not shards or not (cache / "manifest.json").is_file():
        raise ValueError(f"{cache} is not a data cache (manifest.json and shard-*.jsonl)")
    flat, bounds, shard_rows, names = [], [0], [], []
    for f in shards:
        lines = f.read_text().splitlines()
        shard_rows.append(len(lines))
        names.append(f.name)
        for line in lines:
            row = json.loads(line)
            for key in ("prompt_ids", "answer_ids"):
                flat += row[key]
                bounds.append(len(flat))
    top = max(flat, default=0)
    ids = np.asarray(flat, dtype=np.uint16 if top < 1 << 16 else np.uint32)
    meta = {"format": FORMAT, "manifest": json.loads((cache / "manifest.json").read_text()), "shards": names,
            "shard_rows": shard_rows}
    prompts = (cache / "prompts.jsonl").read_bytes() if (cache / "prompts.jsonl").exists() else b""
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}.npz")
    np.savez_compressed(tmp, ids=ids, bounds=np.asarray(bounds, dtype=np.int64),
                        meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                        prompts=np.frombuffer(prompts, dtype=np.uint8))
    os.replace(tmp, dest)
    return {"shards": len(names), "rows": sum(shard_rows), "tokens": int(ids.size), "bytes": dest.stat().st_size}


def unpack(src: Path, cache: Path) -> dict:
    """Write the cache packed in `src` to `cache` (a new directory, or one holding the same data)."""
    src, cache = Path(src), Path(cache)
    with np.load(src) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{src} is not a packed data cache ({FORMAT})")
        ids, bounds, prompts = z["ids"].tolist(), z["bounds"].tolist(), bytes(z["prompts"])
    tmp = cache.with_name(f".{cache.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    names, counts, manifest = _layout(meta)
    k = 0
    for name, n in zip(names, counts):
        out = io.StringIO()
        for _ in range(n):
            p, a = ids[bounds[k]:bounds[k + 1]], ids[bounds[k + 1]:bounds[k + 2]]
            out.write(json.dumps({"prompt_ids": p, "answer_ids": a}) + "\n")
            k += 2
        (tmp / name).write_text(out.getvalue())
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if prompts:
        (tmp / "prompts.jsonl").write_bytes(prompts)
    if cache.exists():
        same = all((cache / f.name).exists() and (cache / f.name).read_bytes() == f.read_bytes()
                   for f in tmp.glob("shard-*.jsonl"))
        shutil.rmtree(tmp)
        if not same:
            raise ValueError(f"{cache} exists and holds other data; unpack into a new directory")
        return {"shards": len(names), "rows": sum(counts), "existing": True}
    cache.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, cache)
    return {"shards": len(names), "rows": sum(counts)}


def _layout(meta: dict) -> tuple[list[str], list[int], dict]:
    """The shard files to write, their row counts and the manifest to write. A manifest with a
    shard_size (the layout before train/data.py answered data.batch prompts per shard) is re-cut
    into shards of data.batch rows, and its shard_size dropped: the rows were written in the
    prompts' length order either way, so each new shard holds the prompts the trainer would give it."""
    manifest = {k: v for k, v in meta["manifest"].items() if k != "shard_size"}
    if "shard_size" not in meta["manifest"]:
        return meta["shards"], meta["shard_rows"], manifest
    rows, per = sum(meta["shard_rows"]), manifest["batch"]
    counts = [min(per, rows - i) for i in range(0, rows, per)]
    return [f"shard-{s:05d}.jsonl" for s in range(len(counts))], counts, manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unpack", action="store_true", help="FILE.npz CACHE: write the packed cache back")
    ap.add_argument("src", type=Path)
    ap.add_argument("dest", type=Path)
    a = ap.parse_args()
    if not a.src.exists():
        raise ConfigError(f"{a.src} does not exist; pass a data cache folder (or, with --unpack, a packed .npz)")
    try:
        print(json.dumps(unpack(a.src, a.dest) if a.unpack else pack(a.src, a.dest)))
    except (ValueError, KeyError) as e:  # a cache or file of the wrong shape: the input's fault
        raise ConfigError(f"{a.src}: {e}") from None


if __name__ == "__main__":
    from harness.faults import guarded

    sys.exit(guarded(main, "python -m train.pack"))
