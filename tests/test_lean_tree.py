"""jobs/lean-tree.sh: the big tracked folders moved aside for the device's stash calls, and back
whole; refused on a dirty tree or over an earlier aside, so nothing is lost."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parent.parent / "jobs" / "lean-tree.sh"
BIG = ("docs", "harness/data/fixtures", "harness/data/drafters")


def run(root: Path, *args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          env={**os.environ, "LEAN_ROOT": str(root), "LEAN_ASIDE": str(root.parent / "aside")})


def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for i, d in enumerate(BIG):
        (root / d).mkdir(parents=True)
        (root / d / f"f{i}.bin").write_bytes(os.urandom(1000 + i))
    (root / "engines").mkdir()
    (root / "engines" / "a.py").write_text("x = 1\n")
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    return root


def files(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and ".git" not in p.parts}


def test_aside_then_back_restores_every_file(tmp_path):
    root = repo(tmp_path)
    before = files(root)
    r = run(root, "aside")
    assert r.returncode == 0, r.stderr
    assert set(files(root)) == {Path("engines/a.py")}
    assert run(root, "status").returncode == 1
    r = run(root, "back")
    assert r.returncode == 0, r.stderr
    assert files(root) == before
    assert run(root, "status").returncode == 0
    assert not (tmp_path / "aside").exists()


def test_a_second_aside_and_a_dirty_tree_are_refused(tmp_path):
    root = repo(tmp_path)
    assert run(root, "aside").returncode == 0
    r = run(root, "aside")
    assert r.returncode == 2 and "was not put back" in r.stderr
    assert run(root, "back").returncode == 0
    (root / "engines" / "a.py").write_text("x = 2\n")
    r = run(root, "aside")
    assert r.returncode == 2 and "has changes" in r.stderr
    assert (root / "docs").is_dir()


def test_back_refuses_to_overwrite_a_folder_that_came_back_another_way(tmp_path):
    root = repo(tmp_path)
    assert run(root, "aside").returncode == 0
    subprocess.run(["git", "-C", str(root), "checkout", "--", "."], check=True)  # the tree restored from git
    r = run(root, "back")
    assert r.returncode == 2 and "exists" in r.stderr
    assert (tmp_path / "aside").is_dir()  # the moved copy is kept, not lost


def test_docs_alone_aside_keeps_the_fixtures_and_drafters_and_comes_back_whole(tmp_path):
    root = repo(tmp_path)
    before = files(root)
    r = run(root, "docs")
    assert r.returncode == 0, r.stderr
    assert set(files(root)) == {p for p in before if p.parts[0] != "docs"}  # what a harness call needs stays
    r = run(root, "back")
    assert r.returncode == 0 and r.stdout.strip() == "lean-tree: docs back in place", r.stderr
    assert files(root) == before and not (tmp_path / "aside").exists()
