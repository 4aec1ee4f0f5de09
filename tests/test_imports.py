"""The project's import graph, read from source with `ast` (nothing is imported).

Floors, lowest first: engines/ (token ids in, token ids out), then harness/, train/ and
report/ above it. A lower floor never imports a higher one, and no module imports itself
back through others, not even through an import inside a function: such an import only
hides the circle until the function runs. Imports inside functions stay for what they are
for, keeping MLX and other heavy libraries out of a module's import (`python -m tests.test_imports`
lists them with their count, which issue 33 tracks).

The report reads records only: no module under report/ imports MLX, mlx-lm or engines/, not
itself and not through the project modules it imports (tests/test_report_imports.py checks
the same by importing it).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO

UPPER = ("harness", "report", "train")  # the floors above engines/
HEAVY = ("mlx", "mlx_lm")  # libraries the report must never load (engines/ loads them too)
# all the report takes from harness/: records and their numbers, and the leaf modules every entry point
# shares (the error classes and the fault boundary, which import nothing of MLX)
REPORT_READS = ("harness.records", "harness.stats", "harness.summary", "harness.errors", "harness.faults")
# What moved into harness/models/ (issue 33), by its old name: no file may come back there (a shim
# would keep two spellings alive) and no module, test, script or page may still use the old one.
MOVED_FILES = ("harness/models.py", "harness/gguf_import.py", "harness/gguf_tokenizer.py", "harness/packaged.py",
               "harness/fixtures.py", "harness/scale.py")
OLD_SPELLINGS = re.compile(
    r"\bharness\.(gguf_import|gguf_tokenizer|packaged|fixtures|scale)\b"  # now harness.models.<module>
    r"|\bfrom harness import [^\n]*\b(models|gguf_import|gguf_tokenizer|packaged|fixtures|scale)\b"
    r"|\bfrom harness\.models import [^\n]*\b(load_target|resolve_model|named_model_file|TargetError)\b"
    r"|\bharness\.config import [^\n]*\b(resolve_drafter|shipped_drafter|DEFAULT_FIXTURE_DRAFT_MODEL)\b")
SCANNED = ("harness", "engines", "train", "report", "tests", "jobs", "examples", "docs", "conf")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the project module it imports
    names: tuple[str, ...]  # what `from target import ...` takes from it (empty for `import target`)
    line: int
    top: bool  # True: runs when `source` is imported; False: inside a function, when that runs


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the packages at `root` (each directory with an __init__.py)."""
    out = {}
    for init in root.glob("*/__init__.py"):
        for path in init.parent.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _project_module(name: str, known: dict[str, Path]) -> str | None:
    # `import a.b.c` and `from a.b import c` load the longest prefix that is a module of ours.
    parts = name.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in known), None)


def _statements(tree: ast.AST, top: bool = True):
    """(statement, top) for every import statement, top False once inside a function."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, top
        inner = top and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _statements(node, inner)


def _absolute(node: ast.ImportFrom, name: str, path: Path) -> str:
    """The module `from ... import` names, with a relative one (level dots) made absolute."""
    if not node.level:
        return node.module
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    return ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    out = []
    for node, top in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [(_project_module(a.name, known), ()) for a in node.names]
        else:
            base = _absolute(node, name, path)
            subs = [a.name for a in node.names if f"{base}.{a.name}" in known]
            targets = [(f"{base}.{s}", ()) for s in subs]
            taken = tuple(a.name for a in node.names if a.name not in subs)
            if taken and _project_module(base, known):
                targets.append((_project_module(base, known), taken))
        out += [Import(name, t, names, node.lineno, top) for t, names in targets if t and t != name]
    return out


def import_graph(root: Path = REPO) -> list[Import]:
    known = modules(root)
    return [imp for name, path in sorted(known.items()) for imp in imports_of(name, path, known)]


def cycles(imports: list[Import]) -> list[tuple[str, ...]]:
    """The modules of each import circle (each strongly connected group of two or more)."""
    graph = defaultdict(set)
    for imp in imports:
        graph[imp.source].add(imp.target)
    reach = {m: _reachable(graph, m) for m in list(graph)}
    return sorted({tuple(sorted(w for w in reach[m] if m in reach.get(w, ()))) for m in reach if m in reach[m]})


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for t in graph.get(todo.pop(), ()):
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return seen


def defined_at_top(path: Path) -> set[str]:
    """Names a module binds when imported (defs, classes, assignments, imports), for `from m import name`."""
    names, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            todo += [n for field in ("body", "orelse", "finalbody", "handlers") for n in getattr(node, field, [])]
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return names


def heavy_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, top) for every import of MLX or mlx-lm in a file."""
    out = []
    for node, top in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:  # a relative import stays inside the project
            names = [node.module] if not node.level else []
        out += [(n, node.lineno, top) for n in names if n.split(".")[0] in HEAVY]
    return out


def loaded_by(source: str, imports: list[Import], known: dict[str, Path]) -> dict[str, list[str]]:
    """Every project module that loading `source` and running its functions can load: its own
    imports (inside functions too), then theirs at module level, and the package above each.
    Each with the chain of modules that gets there, `source` first."""
    top = defaultdict(list)
    for imp in imports:
        if imp.top:
            top[imp.source].append(imp.target)
    todo = [[source, imp.target] for imp in imports if imp.source == source]
    todo += [[source, p] for p in _above(source, known)]
    chains: dict[str, list[str]] = {}
    while todo:
        chain = todo.pop(0)  # breadth first: each module's shortest chain
        if chain[-1] not in chains:
            chains[chain[-1]] = chain
            todo += [chain + [t] for t in top[chain[-1]] + _above(chain[-1], known)]
    return chains


def _above(name: str, known: dict[str, Path]) -> list[str]:
    # importing a.b.c runs a/__init__.py and a/b/__init__.py first
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in known]


def report_loads(root: Path = REPO) -> list[str]:
    """Each way a report/ module reaches MLX, mlx-lm or engines/, as a chain of modules."""
    known, graph = modules(root), import_graph(root)
    found = []
    for name in sorted(n for n in known if n.split(".")[0] == "report"):
        reached = {name: [name], **loaded_by(name, graph, known)}
        found += [" -> ".join(chain) for mod, chain in reached.items()
                  if mod.split(".")[0] == "engines" and chain[-2].split(".")[0] != "engines"]
        # an engines/ module is named where the chain enters engines/; its own MLX goes unsaid
        found += [f"{' -> '.join(chain)} -> {lib} ({known[mod].relative_to(root)}:{line})"
                  for mod, chain in reached.items() if mod.split(".")[0] != "engines"
                  for lib, line, top in heavy_imports(known[mod]) if top or mod == name]
    return found


def _where(imp: Import, known: dict[str, Path]) -> str:
    return f"{known[imp.source].relative_to(REPO)}:{imp.line}"


def test_no_import_cycle_among_module_level_imports():
    found = cycles([imp for imp in import_graph() if imp.top])
    assert not found, f"module-level import cycles (each line: the modules of one circle): {found}"


def test_no_import_cycle_even_through_imports_inside_functions():
    found = cycles(import_graph())
    assert not found, (f"import cycles once imports inside functions count: {found}; move what both sides need "
                       "into a module below them (errors into harness/errors.py or engines/errors.py)")


def test_engines_import_nothing_from_harness_report_or_train():
    known = modules(REPO)
    up = [f"{_where(imp, known)} imports {imp.target}" for imp in import_graph()
          if imp.source.split(".")[0] == "engines" and imp.target.split(".")[0] in UPPER]
    assert not up, f"engines/ must not reach up into {', '.join(UPPER)}: {up}"


def test_every_import_of_a_project_module_names_what_that_module_defines():
    # An import inside a function fails only when the function runs: a name that moved (an
    # error class, an event) must not leave one behind. Also counts those imports.
    known = modules(REPO)
    graph = import_graph()
    stale = [f"{_where(imp, known)}: {imp.target} has no {n}" for imp in graph
             for n in imp.names if n != "*" and n not in defined_at_top(known[imp.target])]
    print(f"function-level imports of project modules: {sum(not imp.top for imp in graph)}")
    assert not stale, stale


def old_spellings(root: Path = REPO) -> list[str]:
    """file:line of every use of a moved module by its old name (OLD_SPELLINGS) in source, scripts and docs."""
    files = [p for d in SCANNED for p in (root / d).rglob("*") if p.suffix in (".py", ".sh", ".md", ".yaml")]
    files += [p for p in root.glob("*") if p.suffix in (".md", ".toml", ".txt")]
    return [f"{p.relative_to(root)}:{n}: {m.group(0)}" for p in sorted(files) if p != Path(__file__).resolve()
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            for m in [OLD_SPELLINGS.search(line)] if m]


def test_moved_model_modules_stay_moved_with_no_shim_and_no_caller_by_the_old_name():
    back = [f for f in MOVED_FILES if (REPO / f).exists()]
    assert not back, f"{back} moved into harness/models/ (docs/layout.md); import harness.models.<module> instead"
    old = old_spellings()
    assert not old, f"old module names, moved into harness/models/: {old}"


# engines/ grouped by role (issue 53): methods/, drafters/, runtime/, kernels/, arms/. A module's old flat
# name must not come back, as a file or in a caller (docs/benchmarks/ keep the names their records ran with).
ENGINE_GROUPS = ("methods", "drafters", "runtime", "kernels", "arms")
FLAT_ENGINES = re.compile(r"(?<![\w./])engines[./](autoregressive|control|ngram|draft_model|mtp|dflash|eagle3|device|"
                          r"target|cache|static|prefix|hidden|tree|sampling|forced|dispatch|checkpoint|shared_weights|"
                          r"patches|torch_bin|gemm|live_attention|deltanet|external|outside)\b"
                          r"|from engines import [^\n]*\b(target|cache|static|gemm|live_attention|deltanet|outside|patches|"
                          r"shared_weights)\b")


def test_engines_stay_grouped_by_role_with_no_module_or_caller_by_a_flat_name():
    flat = sorted(p.name for p in (REPO / "engines").glob("*.py"))
    assert flat == ["__init__.py", "base.py", "errors.py", "home.py", "registry.py"], (
        f"engines/ keeps only the protocol, the registry, errors and home at its top; put {flat} in one of "
        f"{ENGINE_GROUPS} (docs/layout.md)")
    files = [p for d in SCANNED for p in (REPO / d).rglob("*") if p.suffix in (".py", ".sh", ".md", ".yaml")
             and "benchmarks" not in p.relative_to(REPO).parts]
    files += [p for p in REPO.glob("*") if p.suffix in (".md", ".toml", ".txt")]
    old = [f"{p.relative_to(REPO)}:{n}" for p in sorted(files) if p != Path(__file__).resolve()
           for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if FLAT_ENGINES.search(line)]
    assert not old, f"flat engines/ names (now engines/<role>/<module>): {old}"

def test_the_old_spelling_check_catches_each_kind_of_old_name(tmp_path):
    lines = ["from harness.fixtures import fixture_dir", "from harness import packaged", "import harness.scale",
             "python -m harness.scale llama-1b /tmp/x", "from harness.models import load_target, resolve_model",
             "from harness.config import canonical_cell, resolve_drafter", "from harness.models import fixtures",
             "from harness.models.resolve import resolve_model"]
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "a.sh").write_text("\n".join(lines) + "\n")
    assert [x.split(":")[1] for x in old_spellings(tmp_path)] == ["1", "2", "3", "4", "5", "6"]


def test_the_report_imports_no_mlx_and_no_engines_not_even_through_harness():
    found = report_loads()
    assert not found, (f"report/ must read records only, without MLX, mlx-lm or engines/: {found}; move what it "
                       "needs into a module that imports none of them (as harness/summary.py)")


def test_the_report_takes_from_harness_only_records_stats_and_summary():
    known = modules(REPO)
    other = [f"{_where(imp, known)} imports {imp.target}" for imp in import_graph()
             if imp.source.split(".")[0] == "report" and imp.target.split(".")[0] == "harness"
             and imp.target not in REPORT_READS]
    assert not other, f"report/ reads records, stats and the summary only ({', '.join(REPORT_READS)}): {other}"


def test_the_report_check_catches_mlx_through_a_chain_and_engines_inside_a_function(tmp_path):
    files = {"report/__init__.py": "", "report/a.py": "from harness import b, lazy\n",
             "report/c.py": "def f():\n    from engines.x import y\n",
             "harness/__init__.py": "", "harness/b.py": "from harness.c import z\n",
             "harness/c.py": "import mlx.core as mx\nz = 1\n", "harness/lazy.py": "def f():\n    import mlx_lm\n",
             "engines/__init__.py": "", "engines/x.py": "y = 1\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert report_loads(tmp_path) == ["report.a -> harness.b -> harness.c -> mlx.core (harness/c.py:1)",
                                      "report.c -> engines.x"]


def test_the_checks_catch_a_planted_cycle_an_upward_import_and_a_stale_name(tmp_path):
    files = {"engines/__init__.py": "", "engines/a.py": "def f():\n    from harness.b import g\n",
             "harness/__init__.py": "", "harness/b.py": "from harness.c import x\ng = 1\n",
             "harness/c.py": "from harness import b\nx = 1\n", "harness/d.py": "def f():\n    from harness.c import gone\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert cycles([imp for imp in graph if imp.top]) == [("harness.b", "harness.c")]
    assert [(imp.source, imp.target, imp.top) for imp in graph if imp.source == "engines.a"] == \
        [("engines.a", "harness.b", False)]
    assert "gone" not in defined_at_top(tmp_path / "harness/c.py") and "x" in defined_at_top(tmp_path / "harness/c.py")


if __name__ == "__main__":
    lazy = [imp for imp in import_graph() if not imp.top]
    for imp in lazy:
        print(f"{_where(imp, modules(REPO))}: {imp.target}")
    print(f"function-level imports of project modules: {len(lazy)}")


# Library-internal modules a runtime or kernel builds on (a rope over tree positions, a conv tap): not drafters.
RUNTIME_MODULES = {"engines.runtime.tree._TreeRope", "engines.kernels.deltanet._ConvTap"}


def _nn_modules(path: Path) -> list[str]:
    """Classes in `path` that derive from mlx's nn.Module (by their base's spelling)."""
    tree = ast.parse(path.read_text())
    return [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
            and any(ast.unparse(b) in ("nn.Module", "mlx.nn.Module", "Module") for b in n.bases)]


def test_drafter_networks_live_in_engines_drafters_and_train_takes_them_from_there():
    known = modules(REPO)
    outside = [f"{name}.{cls}" for name, path in known.items()
               if name.split(".")[0] in ("engines", "harness", "train") and not name.startswith("engines.drafters")
               for cls in _nn_modules(path) if f"{name}.{cls}" not in RUNTIME_MODULES]
    assert not outside, f"networks defined outside engines/drafters/: {outside} (docs/adding-a-method.md)"
    wrong = [f"{_where(imp, known)}: {imp.target}" for imp in import_graph() if imp.source.startswith("train.")
             and imp.target.startswith("engines.methods.")]
    assert not wrong, f"train/ takes drafters from engines/drafters/, not from the methods: {wrong}"


def test_the_drafter_kinds_are_listed_once():
    from engines.drafters import DRAFTERS, KINDS
    from train.__main__ import OBJECTIVES

    assert set(OBJECTIVES) == set(KINDS) and KINDS == tuple(DRAFTERS)
    for kind in KINDS:  # each kind's module exists where the table says
        assert (REPO / (DRAFTERS[kind].module.replace(".", "/") + ".py")).is_file(), kind
    listed = re.compile(r"\(\s*\"(eagle3|dflash|mtp|draft_model)\",\s*\"(eagle3|dflash|mtp|draft_model)\"")
    again = [f"{p.relative_to(REPO)}:{n}" for d in ("engines", "harness", "train") for p in (REPO / d).rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if listed.search(line)]
    assert not again, f"a list of drafter kinds besides engines/drafters DRAFTERS: {again}"
