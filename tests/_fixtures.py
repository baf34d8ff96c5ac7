"""The committed fixtures, found loudly: a missing fixture folder or file is an error at collection time,
never a skipped test (a test that skips when its input is gone can go green while broken)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
DS = FIXTURES / "ds"


def fixture(*parts: str) -> Path:
    """``fixtures/<parts...>``, which must exist."""
    p = FIXTURES.joinpath(*parts)
    if not p.exists():
        raise FileNotFoundError(f"{p}: committed fixture missing (restore it: git checkout -- fixtures/)")
    return p


def ds_cases(*, stages: tuple[int, ...] = (0, 1, 2, 3), bf16_optimizer: bool | None = None) -> list[str]:
    """Names of the committed real DeepSpeed cases under fixtures/ds (at least one, or an error)."""
    out = []
    for d in sorted(fixture("ds").glob("*/case.json")):
        c = json.loads(d.read_text())
        if c["stage"] in stages and (
            bf16_optimizer is None or bool(c.get("bf16_optimizer")) == bf16_optimizer
        ):
            out.append(d.parent.name)
    if not out:
        raise FileNotFoundError(f"{DS}: no DeepSpeed fixture case matches (restore fixtures/ds)")
    return out


def load_script(path: Path, name: str) -> Any:
    """A test script (``tests/data/*.py``) imported as module ``name`` without running its ``__main__``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
