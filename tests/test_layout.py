"""The code keeps its shape (issue #14): every module of ``zckpt`` and ``engine`` has a docstring, none is
over 500 lines, no function over 80 lines, no module-level import cycle in either package, ``zckpt`` never
imports ``engine``, and ``import zckpt.partition`` (the pure math the engine needs) loads at most 4 zckpt
modules, and docs/architecture.md lists every module and folder of both (and the helpers, bench scripts, docs
and fixture generators it says it lists) with only paths that exist. The layer contracts themselves are
``lint-imports``' (pyproject ``[tool.importlinter]``).

Static (``ast`` only, nothing is imported) except the import-cost check. Imports under ``if TYPE_CHECKING:``
are not edges; imports inside functions are (a deferred import still ties the two modules together).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
PACKAGES = (ROOT / "zckpt", ENGINE)


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return skip


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The ``modules`` that ``path`` imports (``from a.x import y`` names ``a.x.y`` if that is a module)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    here = _name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + [base]).strip(".")
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if m in modules and m != here}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)) is not None:
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def _sources() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted(pkg.rglob("*.py"))]


def test_modules_have_docstrings_and_stay_small() -> None:
    for path in _sources():
        text = path.read_text()
        tree = ast.parse(text)
        assert ast.get_docstring(tree), f"{path.relative_to(ROOT)} has no module docstring"
        assert len(text.splitlines()) <= 500, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                assert n <= 80, f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is {n} lines"


def test_no_import_cycle_between_modules() -> None:
    paths = _sources()
    modules = {_name(p) for p in paths}
    graph = {_name(p): _imports(p, modules) for p in paths}
    assert graph["engine.engine"] and graph["zckpt.ops.consolidate"], "the import scan found nothing"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_import_partition_stays_light() -> None:
    """The engine imports ``zckpt.partition`` for its math: that must not pull in readers, I/O or the CLI."""
    code = "import sys, zckpt.partition; print(sorted(m for m in sys.modules if m.startswith('zckpt')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = ast.literal_eval(out.stdout.strip())
    assert len(loaded) <= 4, loaded


def test_zckpt_never_imports_engine() -> None:
    for path in sorted((ROOT / "zckpt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            assert not any(n == "engine" or n.startswith("engine.") for n in names), path


ARCH = ROOT / "docs" / "architecture.md"


def _arch_listed() -> list[str]:
    """The paths docs/architecture.md lists: the first word of each line of its code blocks."""
    blocks = ARCH.read_text().split("```")[1::2]
    return [line.split()[0] for b in blocks for line in b.splitlines() if line.strip()]


def _files(top: Path, *, pattern: str = "*", recursive: bool = True) -> list[Path]:
    found = top.rglob(pattern) if recursive else top.glob(pattern)
    return [p for p in found if "__pycache__" not in p.parts and p.suffix != ".pyc"]


def _must_be_listed() -> set[str]:
    """What docs/architecture.md says it lists: every folder and file of zckpt/ and engine/; tests' helpers
    (``_*.py``, conftest.py) and every file of its sub-folders; every file of bench/ (its generated data and
    node_modules aside), of docs/, and directly in fixtures/."""
    paths: list[Path] = []
    for pkg in PACKAGES:
        paths += _files(pkg)
    tests = ROOT / "tests"
    paths += _files(tests, pattern="_*.py", recursive=False) + [tests / "conftest.py"]
    for sub in ("data", "fuzz", "stress"):
        paths += [p for p in _files(tests / sub) if p.is_file()]
    generated = {"data", "node_modules"}
    paths += [p for p in _files(ROOT / "bench") if p.is_file() and not generated & set(p.parts)]
    paths += [p for p in _files(ROOT / "docs") if p.is_file()]
    paths += [p for p in _files(ROOT / "fixtures", recursive=False) if p.is_file()]
    return {str(p.relative_to(ROOT)) + ("/" if p.is_dir() else "") for p in paths}


def test_architecture_doc_lists_every_module_and_names_only_real_paths() -> None:
    """docs/architecture.md, one line per path: every path it names exists (``<case>/`` stands for the
    fixture cases under its parent, ``*`` for a set of files, at least one), and it lists everything it says
    it lists."""
    listed = _arch_listed()
    covered: set[str] = set()
    missing = []
    for entry in listed:
        if "<" in entry:
            parent = ROOT / entry.split("<", 1)[0]
            ok = parent.is_dir() and any(p.is_dir() for p in parent.iterdir())
        elif "*" in entry:
            hits = sorted(ROOT.glob(entry))
            covered.update(str(p.relative_to(ROOT)) for p in hits)
            ok = bool(hits)
        else:
            covered.add(entry)
            ok = (ROOT / entry).is_dir() if entry.endswith("/") else (ROOT / entry).is_file()
        if not ok:
            missing.append(entry)
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
    unlisted = sorted(_must_be_listed() - covered)
    assert not unlisted, f"docs/architecture.md does not list (one line each, with its role): {unlisted}"
    assert len(listed) == len(set(listed)), "docs/architecture.md lists a path twice"
