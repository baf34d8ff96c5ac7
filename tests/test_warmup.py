"""The command line's read-ahead of a local input while torch imports (``zckpt.ops.warmup``, started by
``zckpt.cli.app._preopen`` in a ``zckpt.storage.preopen`` child).

Oracles: hand-made pieces for the ranges (merged where adjacent, cut at the budget); the checkpoint's own
entries for what a real DeepSpeed fixture's read-ahead covers; ``sys.modules`` for "no torch"; ``waitpid``
for a child the command did not take being reaped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from zckpt import dtypes
from zckpt.formats import open_checkpoint
from zckpt.model import Piece, Role, TensorEntry
from zckpt.ops import warmup

REPO = Path(__file__).resolve().parents[1]
DS = REPO / "fixtures" / "ds" / "s3_bf16_w2_g2"


def _entry(name: str, *pieces: tuple[str, int, int]) -> TensorEntry:
    f32 = dtypes.of("float32")
    ps, start = [], 0
    for file, off, n in pieces:
        ps.append(Piece(file=file, byte_offset=off, dtype=f32, start=start, numel=n))
        start += n
    return TensorEntry(name=name, shape=(start,), dtype=f32, role=Role.PARAM, pieces=tuple(ps))


def test_ranges_merge_adjacent_pieces_and_stop_at_the_budget() -> None:
    a = _entry("a", ("r0", 0, 4), ("r1", 64, 4))  # 16 bytes each
    b = _entry("b", ("r0", 16, 2), ("r1", 80, 2), ("r0", 100, 8))
    assert warmup.ranges([a, b], 1 << 20) == [
        ("r0", 0, 16), ("r1", 64, 16), ("r0", 16, 8), ("r1", 80, 8), ("r0", 100, 32),
    ]  # fmt: skip
    assert warmup.ranges([a, b], 20) == [("r0", 0, 16), ("r1", 64, 4)]
    assert warmup.ranges([a, b], 0) == []


def test_ranges_of_a_deepspeed_checkpoint_are_its_model_bytes() -> None:
    """On a real DeepSpeed ZeRO-3 save: with no budget limit, the ranges hold exactly the stored bytes of the
    model tensors (the fp32 masters of the parameters live in the optimizer-state files)."""
    with open_checkpoint(DS, model_only=True) as ck:
        entries = ck.model_entries()
        got = warmup.ranges(entries, 1 << 40)
        want = sum(e.stored_nbytes for e in entries)
        masters = {p.file for e in entries if e.role is Role.PARAM for p in e.pieces}
    assert sum(n for *_, n in got) == want > 0
    assert masters and all("optim_states" in Path(f).name for f in masters), masters
    assert {f for f, *_ in got} >= masters


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_child_imports_no_torch_and_an_untaken_child_is_reaped() -> None:
    """The command line's target runs without torch (it overlaps torch's import); a child nobody took is
    ended and reaped when the command ends (``discard``), its memory file closed."""
    out = _run(f"""
        import os, sys
        from zckpt.cli import app
        from zckpt.storage import preopen
        module, _, name = app._WARMUP.partition(":")
        assert getattr(preopen._import_bare(module), name)({str(DS)!r}) == b""
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        children = {{}}
        assert preopen.start(children, app._WARMUP, {str(DS)!r})
        (child,) = children.values()
        preopen.discard(children)
        assert not children
        try:
            os.waitpid(child.pid, 0)
        except ChildProcessError:
            print("reaped")
    """)
    assert out.split() == ["reaped"]


def test_consolidate_with_the_read_ahead_equals_the_library_call(tmp_path: Path) -> None:
    """The ``zckpt`` program, on a job that imports torch (a ``.bin`` output), starts the read-ahead child
    for its input and writes what the library call writes."""
    from zckpt import consolidate

    cli = tmp_path / "cli.bin"
    code = f"""
        import sys
        from zckpt.storage import preopen
        started = []
        real_start = preopen.start
        preopen.start = lambda c, t, p: started.append((t, real_start(c, t, p))) or started[-1][1]
        sys.argv = ["zckpt", "consolidate", {str(DS)!r}, {str(cli)!r}, "--no-progress"]
        from zckpt.cli import main
        try:
            main()
        finally:
            sys.stderr.write(f"started={{started}}\\n")
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "ZCKPT_FAST_EXIT": "0"}, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"started=[({warmup_target()!r}, True)]" in done.stderr.splitlines()[-1], done.stderr
    consolidate(DS, tmp_path / "lib.bin", progress=False)
    assert cli.read_bytes() == (tmp_path / "lib.bin").read_bytes()


def warmup_target() -> str:
    from zckpt.cli import app

    return app._WARMUP
