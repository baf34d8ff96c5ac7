"""``python -m engine.run [-m MODULE | SCRIPT] ARGS...`` (console script ``engine-run``): run a script written
for DeepSpeed on the engine, chosen on purpose, for this process only.

The launcher puts ``engine/alias`` first on ``sys.path`` and then runs the script as ``__main__`` (or the
module, as ``python -m`` does). That folder holds the ``deepspeed`` package (``engine.alias``'s doc: it *is*
the ``engine`` module, with DeepSpeed's submodule names) and its distribution metadata
(``deepspeed-0.19.8+engine.dist-info``), so ``importlib.metadata.version("deepspeed")`` is
``0.19.8+engine``: the DeepSpeed API version the engine follows, with a local label. Libraries that check for
DeepSpeed see one consistent answer: transformers' ``is_deepspeed_available()`` (a module spec and a
distribution) is True, accelerate's ``compare_versions("deepspeed", ">=", ...)`` compares 0.19.8, and
``deepspeed.__version__`` says the same. Processes started by ``torch.multiprocessing`` (spawn) inherit the
path; ``torchrun -m engine.run SCRIPT`` starts each rank through the launcher.

Nothing else changes: no ``.pth`` file, no environment variable, no import hook; a plain ``python SCRIPT`` in
the same environment does not see the engine as ``deepspeed``. When real DeepSpeed is importable in the
environment, the launcher refuses with one line and exit status 2 (which package answers ``import deepspeed``
would otherwise depend on path order).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import runpy
import sys
from pathlib import Path

ALIAS = Path(__file__).resolve().parent / "alias"
"""The folder put first on ``sys.path``: the ``deepspeed`` package and its ``.dist-info``."""
USAGE = "usage: python -m engine.run [-m MODULE | SCRIPT] [ARGS...]  (runs it with the engine as `deepspeed`)"


def _is_alias(origin: str | None) -> bool:
    """Whether ``origin`` is an engine alias package (any checkout's ``engine/alias/deepspeed``)."""
    if not origin:
        return False
    p = Path(origin).resolve()
    return p.name == "__init__.py" and [q.name for q in p.parents[:3]] == ["deepspeed", "alias", "engine"]


def real_deepspeed() -> str | None:
    """Where real DeepSpeed is importable in this environment, or None: a ``deepspeed`` module that is not an
    engine alias, or a ``deepspeed`` distribution that is not the engine's."""
    loaded = sys.modules.get("deepspeed")
    if loaded is not None:
        import engine

        if loaded is engine:  # already active in this process (the alias registers the engine module)
            return None
        return f"already imported from {getattr(loaded, '__file__', None)}"
    spec = importlib.util.find_spec("deepspeed")
    if spec is not None and not _is_alias(spec.origin):
        return str(spec.origin or next(iter(spec.submodule_search_locations or []), "a namespace package"))
    for dist in importlib.metadata.distributions(name="deepspeed"):
        if not str(dist.version).endswith("+engine"):
            return f"distribution deepspeed {dist.version} in {dist.locate_file('')}"
    return None


class RealDeepSpeed(RuntimeError):
    """Real DeepSpeed is importable where the engine was asked to stand in for it."""


def activate() -> None:
    """Make ``import deepspeed`` the engine in this process from now on (what the launcher does before it runs
    the script; tests call it in-process). Raises ``RealDeepSpeed`` where real DeepSpeed is importable."""
    real = real_deepspeed()
    if real is not None:
        raise RealDeepSpeed(
            f"real DeepSpeed is importable here ({real}); the engine stands in for `deepspeed` only where "
            "DeepSpeed is not installed: run the script with DeepSpeed, or from an environment without it "
            "(pip uninstall deepspeed)"
        )
    if str(ALIAS) not in sys.path:
        sys.path.insert(0, str(ALIAS))
        importlib.invalidate_caches()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "-m" and len(args) < 2:
        print(f"engine.run: -m needs a module name; {USAGE}", file=sys.stderr)
        return 2
    if args[0] != "-m" and not Path(args[0]).is_file():
        print(f"engine.run: {args[0]}: no such script; {USAGE}", file=sys.stderr)
        return 2
    try:
        activate()
    except RealDeepSpeed as e:
        print(f"engine.run: {e}", file=sys.stderr)
        return 2
    if args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path.insert(0, str(Path(args[0]).resolve().parent))  # as `python SCRIPT` puts its folder first
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
