"""jobs/ptx-cache.sh: MLX's compiled CUDA kernels saved on one machine and restored on the next,
refused whole when they would not come back from a device call."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "jobs" / "ptx-cache.sh"


def run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **{k: str(v) for k, v in env.items()}})


def kernels(root: Path, big: int = 0) -> Path:
    ptx = root / "0.32.4" / "ptx"
    ptx.mkdir(parents=True)
    (ptx / "gather.txt").write_text("gather\t_Z6gatherv\n")
    (ptx / "gather.ptx").write_bytes(os.urandom(2048 + big))
    return root


def tree(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_save_then_restore_gives_the_same_files(tmp_path):
    src = kernels(tmp_path / "a")
    r = run("save", tmp_path / "k.tgz", MLX_PTX_CACHE_DIR=src)
    assert r.returncode == 0, r.stderr
    assert "1 compiled modules" in r.stdout
    r = run("restore", tmp_path / "k.tgz", MLX_PTX_CACHE_DIR=tmp_path / "b")
    assert r.returncode == 0, r.stderr
    assert tree(tmp_path / "b") == tree(src)


def test_a_cache_over_the_limit_is_refused_and_nothing_is_written(tmp_path):
    src = kernels(tmp_path / "a", big=2 * 1024 * 1024)
    r = run("save", tmp_path / "k.tgz", MLX_PTX_CACHE_DIR=src, PTX_LIMIT_MB=1)
    assert r.returncode == 2
    assert "over the 1 MiB" in r.stderr
    assert list(tmp_path.glob("k.tgz*")) == []


def test_bad_input_is_refused_in_one_line(tmp_path):
    r = run("save", tmp_path / "k.tgz", MLX_PTX_CACHE_DIR=tmp_path / "none")
    assert r.returncode == 2 and "nothing to save" in r.stderr
    (tmp_path / "junk.tgz").write_text("not a tar")
    for verb in ("restore", "stage"):
        r = run(verb, tmp_path / "junk.tgz", MLX_PTX_CACHE_DIR=tmp_path / "b", GPU_DIR=tmp_path / "g")
        assert r.returncode == 2 and "not a gzip tar" in r.stderr, (verb, r.stderr)
    assert run("frobnicate").returncode == 2


def test_stage_makes_a_carry_folder_whose_stash_script_keeps_the_archive(tmp_path):
    src = kernels(tmp_path / "a")
    assert run("save", tmp_path / "k.tgz", MLX_PTX_CACHE_DIR=src).returncode == 0
    r = run("stage", tmp_path / "k.tgz", GPU_DIR=tmp_path / "g")
    assert r.returncode == 0, r.stderr
    staged = tmp_path / "g" / "ptx"
    assert sorted(p.name for p in staged.iterdir()) == ["ptx-cache.tgz", "stash.sh"]
    assert (staged / "ptx-cache.tgz").read_bytes() == (tmp_path / "k.tgz").read_bytes()
