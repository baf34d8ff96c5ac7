"""The command line's pre-open (``zckpt.storage.preopen``): each input DCP folder's ``.metadata`` parsed in a
child forked before torch is imported, taken by the parent only for the very bytes it read itself.

Oracle: the same ``load_metadata`` in one process with no child (the library's path), on every real DCP
fixture; a damaged or hostile ``.metadata`` gives the command line the same one-line error either way.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import zckpt
from tests.fuzz import pickles
from zckpt.errors import ZckptError
from zckpt.formats.dcp import metadata, standins

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "fixtures" / "dcp"


def _folders() -> list[Path]:
    got = sorted(p.parent for p in FIX.glob("**/.metadata"))
    assert len(got) >= 15, f"DCP fixtures missing under {FIX}"
    return got


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_child_parse_equals_the_in_process_parse_on_every_fixture() -> None:
    """Children started before ``import torch``, one per fixture folder; every parent ``load_metadata`` takes
    a child's result, and each equals the parse of the same file with no child."""
    folders = [str(f) for f in _folders()]
    out = _run(f"""
        import os, sys
        from pathlib import Path
        from zckpt.storage import preopen, session
        folders = {folders!r}
        assert preopen.available()
        op = session.Storage()
        for f in folders:
            assert preopen.start(op.cache("preopen"), "zckpt.formats.dcp.metadata:preload",
                                 os.path.realpath(f + "/.metadata"))
        import torch
        from zckpt.dtypes import DType
        from zckpt.formats.dcp import metadata, standins
        taken = []
        real_take = preopen.take
        preopen.take = lambda c, p: taken.append(real_take(c, p)) or taken[-1]
        with op.bound():
            via_child = [metadata.load_metadata(Path(f)) for f in folders]
        assert len(taken) == len(folders) and all(t is not None for t in taken), taken
        assert not op.cache("preopen")
        preopen.take = real_take
        alone = [metadata.load_metadata(Path(f)) for f in folders]  # no operation bound: nothing kept
        for f, a, b in zip(folders, via_child, alone):
            assert a == b, f
            assert a.tensors and all(isinstance(t.dtype, DType) for t in a.tensors.values()), f
        print(len(folders), sum(len(a.storage) for a in via_child))
    """)
    n, stored = map(int, out.split())
    assert n == len(folders) and stored > 100


def test_child_imports_no_torch() -> None:
    """The child's target (the command line's own string) imports and runs without torch: the time it saves
    is torch's import, which it runs beside."""
    path = str(FIX / "fsdp2_w2" / "checkpoint" / ".metadata")
    out = _run(f"""
        import marshal, sys
        from zckpt.cli import app
        from zckpt.storage import preopen
        module, _, name = app._DCP_PRELOAD.partition(":")
        blob = getattr(preopen._import_bare(module), name)({path!r})
        assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
        digest, parsed = marshal.loads(blob)
        print(len(digest), len(parsed[2]))
    """)
    assert out.split()[0] == "16" and int(out.split()[1]) > 0


def test_a_file_changed_after_the_child_read_it_is_parsed_again(tmp_path: Path) -> None:
    """The child parsed one ``.metadata``; the file is replaced before the parent reads it: the parent's
    digest differs, so it parses the bytes it read (another fixture's), not the child's."""
    a, b = FIX / "fsdp2_w2" / "checkpoint", FIX / "tp_w2" / "checkpoint"
    ck = tmp_path / "ck"
    shutil.copytree(a, ck)
    out = _run(f"""
        import os
        from pathlib import Path
        from zckpt.storage import preopen, session
        f = os.path.realpath({str(ck / ".metadata")!r})
        op = session.Storage()
        assert preopen.start(op.cache("preopen"), "zckpt.formats.dcp.metadata:preload", f)
        os.waitid(os.P_PID, op.cache("preopen")[f].pid, os.WEXITED | os.WNOWAIT)  # done, not yet reaped
        Path(f).write_bytes(Path({str(b / ".metadata")!r}).read_bytes())
        from zckpt.formats.dcp import metadata, standins
        taken = []
        real_take = preopen.take
        preopen.take = lambda c, p: taken.append(real_take(c, p)) or taken[-1]
        with op.bound():
            md = metadata.load_metadata(Path(f).parent)
        assert taken and taken[0] is not None  # the child did finish: its result was refused
        other = metadata.build(f, metadata.parse_bytes(Path(f).read_bytes(), f))
        assert md == other
        print(len(md.keys))
    """)
    assert int(out) == len(metadata.load_metadata(b).keys)


def _edited(tmp: Path, edit: Any) -> Path:
    d = tmp / "ck"
    shutil.copytree(FIX / "fsdp2_w2" / "checkpoint", d)
    md = pickles.load_opaque((d / ".metadata").read_bytes())
    edit(md.state)
    (d / ".metadata").write_bytes(pickles.dump_opaque(md))
    return d


def _first_props(state: Any) -> Any:
    tsm = next(v for v in state["state_dict_metadata"].values() if "properties" in (v.state or {}))
    return tsm.state["properties"]


def _set_dtype(value: Any) -> Any:
    def edit(state: Any) -> None:
        props = _first_props(state)
        props.state = (value, *props.state[1:])

    return edit


def _set_size_args(args: list[Any]) -> Any:
    def edit(state: Any) -> None:
        tsm = next(v for v in state["state_dict_metadata"].values() if "chunks" in (v.state or {}))
        size = tsm.state["chunks"][0].state["sizes"]
        assert size.GLOBAL == ("torch", "Size"), size.GLOBAL
        size.args = args

    return edit


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (_set_size_args([(1.5,)]), "unreadable pickle (TypeError"),  # torch.Size takes ints only
        (_set_size_args([b"\x01\x00\x00\x00\x00\x00\x00\x00"]), "torch.Size from bytes"),
        (_set_dtype(pickles.opaque_class("torch", "load")), "asks for torch.load"),
        (_set_dtype(pickles.opaque_class("torch", "Size")), "expected a torch dtype"),
        (_set_dtype(7), "expected a torch dtype"),
        (lambda s: s.pop("storage_data"), "storage_data is missing"),
    ],
    ids=["float-size", "bytes-size", "torch.load", "size-as-dtype", "int-as-dtype", "no-storage-data"],
)
def test_damaged_metadata_same_line_with_and_without_the_child(tmp_path: Path, edit: Any, says: str) -> None:
    """The child fails on it and exits 1; the parent parses the file itself and prints the library's error.
    (``consolidate`` to a ``.bin``: a job that imports torch, which the child runs beside; to a
    ``.safetensors`` it imports none, and ``inspect`` none.)"""
    ck = _edited(tmp_path, edit)
    with pytest.raises(ZckptError) as e:
        zckpt.open(ck)
    assert says in str(e.value)
    code = f"""
        import sys
        from zckpt.storage import preopen
        started = []
        real_start = preopen.start
        preopen.start = lambda c, t, p: started.append(real_start(c, t, p)) or started[-1]
        sys.argv = ["zckpt", "consolidate", {str(ck)!r}, {str(tmp_path / "out.bin")!r}]
        from zckpt.cli import main
        try:
            main()
        finally:
            sys.stderr.write(f"started={{started}}\\n")
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=REPO, env={**__import__("os").environ, "ZCKPT_FAST_EXIT": "0"})  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == f"error: {e.value}", lines
    assert "started=[True]" in lines[-1]


def test_dtype_names_cover_this_torch() -> None:
    """Every dtype this torch has is a name the torch-free unpickle accepts (a new torch adding one fails
    here first), and every listed name this torch has maps to its dtype."""
    have = {k for k, v in vars(torch).items() if isinstance(v, torch.dtype)}
    assert have <= standins.DTYPE_NAMES, sorted(have - standins.DTYPE_NAMES)
    from zckpt import dtypes

    known = {n: dtypes.lookup(n) for n in standins.DTYPE_NAMES & have}
    assert all(d is None or d.torch is getattr(torch, n) for n, d in known.items())
    assert {n for n, d in known.items() if d is not None} >= set(dtypes.BY_NAME)
