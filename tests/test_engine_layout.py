"""The engine's folder keeps its shape (issue #14): every module has a docstring, none is over 500 lines, no
function over 80 lines, no import cycle between engine modules, and ``zckpt`` never imports ``engine``.

Static (``ast`` only, nothing is imported). Imports under ``if TYPE_CHECKING:`` are not edges; imports inside
functions are (a deferred import still ties the two modules together).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"


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
    """The engine modules ``path`` imports (``from engine.x import y`` names ``engine.x.y`` if a module)."""
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


def test_engine_modules_have_docstrings_and_stay_small() -> None:
    for path in sorted(ENGINE.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        assert ast.get_docstring(tree), f"{path.relative_to(ROOT)} has no module docstring"
        assert len(text.splitlines()) <= 500, f"{path.relative_to(ROOT)}: {len(text.splitlines())} lines"
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                assert n <= 80, f"{path.relative_to(ROOT)}:{node.lineno} {node.name} is {n} lines"


def test_no_import_cycle_between_engine_modules() -> None:
    paths = sorted(ENGINE.rglob("*.py"))
    modules = {_name(p) for p in paths}
    graph = {_name(p): _imports(p, modules) for p in paths}
    assert graph["engine.engine"], "the import scan found nothing: the checker is broken"
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_zckpt_never_imports_engine() -> None:
    for path in sorted((ROOT / "zckpt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            assert not any(n == "engine" or n.startswith("engine.") for n in names), path
