"""Run ``zckpt ARGV`` (the program's own command line) in a fresh interpreter that must never import torch:
the shared harness of the "imports no torch" tests. A leak exits with ``LEAK`` (99), not through an
``assert`` (whose exit status, 1, is also what a diff that differs or a verify that finds damage gives)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEAK = 99
"""The exit status when torch (or a ``torch.*`` module) was imported."""


def run_torch_free(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``zckpt ARGV`` in a fresh interpreter from the repository root (``env`` added to this one's); its
    exit status is the command's, or ``LEAK`` if torch was imported."""
    code = f"""
        import sys
        sys.argv = ["zckpt", *{argv!r}]
        from zckpt.cli import app
        code = 0
        try:
            app.app()
        except SystemExit as e:
            code = e.code or 0
        leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        if leaked:
            print("torch imported:", leaked[:5], file=sys.stderr)
            sys.exit({LEAK})
        sys.exit(code)
    """
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO, check=False, env={**os.environ, **(env or {})})  # fmt: skip
