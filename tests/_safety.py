"""Helpers for the safety tests: run the CLI in-process, check its one-line errors, craft pickles and rewrite
the ``data.pkl`` of a torch zip archive (a real DeepSpeed fixture) without disturbing its tensor records.

Pickle payloads are written opcode by opcode (not with ``pickle.dumps``) so building them never resolves,
imports or calls the globals they name.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from _fixtures import fixture
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "ds"
PY = sys.executable


# ---- CLI -----------------------------------------------------------------------------------------
@dataclass
class Run:
    code: int
    stdout: str
    stderr: str


def cli(*args: str | os.PathLike[str], env: dict[str, str] | None = None) -> Run:
    """``zckpt ARGS`` in this process (typer's CliRunner); exceptions escaping the CLI stay visible."""
    from zckpt.cli.app import app

    r = CliRunner().invoke(app, [str(a) for a in args], env=env, catch_exceptions=True)
    err = r.stderr
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        import traceback

        err += "".join(traceback.format_exception(r.exception))
    return Run(r.exit_code, r.stdout, err)


def assert_one_line_error(r: Run, *needles: str) -> str:
    """Non-zero exit, no traceback, exactly one ``error:`` line (plus at most a ``hint:`` line) holding
    every needle (case-insensitive). Returns the error line."""
    assert r.code not in (0, None), f"expected failure, got exit 0\nstdout: {r.stdout}\nstderr: {r.stderr}"
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errs) == 1, f"want one error line, got:\n{r.stderr}"
    others = [ln for ln in lines if not ln.startswith(("error: ", "hint: ", "warning: "))]
    assert not others, f"unexpected stderr lines: {others}"
    for n in needles:
        assert n.lower() in errs[0].lower(), f"{n!r} not in {errs[0]!r}"
    return errs[0]


def leftovers(folder: Path) -> list[str]:
    """Names under ``folder`` that look like zckpt temporaries (``*zckpt-tmp*``, ``*zckpt-old*``)."""
    out = []
    for p in folder.rglob("*"):
        if "zckpt-tmp" in p.name or "zckpt-old" in p.name or p.name.endswith(".tmp"):
            out.append(str(p.relative_to(folder)))
    return out


# a ZeRO-1/2 world-2 case (mp_rank_00_model_states.pt + two optim files) and a ZeRO-3 world-2 case
DS2 = fixture("ds", "s2_fp16_w2").name
DS3 = fixture("ds", "s3_fp32_w2").name


def copy_case(case: str, dest: Path) -> Path:
    """A private copy of the checkpoint of fixture ``fixtures/ds/<case>`` (``latest`` and the tag folders)."""
    out = dest / case
    src = FIXTURES / case
    out.mkdir(parents=True)
    shutil.copy(src / "latest", out / "latest")
    for d in src.iterdir():
        if d.is_dir() and d.name.startswith("global_step"):
            shutil.copytree(d, out / d.name)
    return out


# ---- pickle opcodes ------------------------------------------------------------------------------
def op_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def op_str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def op_call(fn: bytes, *args: bytes) -> bytes:
    """``fn(*args)`` via MARK ... TUPLE REDUCE."""
    return fn + b"(" + b"".join(args) + b"tR"


def op_list(*items: bytes) -> bytes:
    return b"](" + b"".join(items) + b"e"


def op_dict(**kv: bytes) -> bytes:
    return b"}(" + b"".join(op_str(k) + v for k, v in kv.items()) + b"u"


def body(pkl: bytes) -> bytes:
    """A protocol-2 pickle without its PROTO header and STOP: the opcodes that push its object."""
    assert pkl[:2] == b"\x80\x02" and pkl[-1:] == b".", pkl[:4]
    return pkl[2:-1]


def add_key(pkl: bytes, key: str, value_ops: bytes) -> bytes:
    """The pickle of a dict ``pkl`` with one more item ``key: <value_ops>`` (SETITEM after the dict)."""
    return b"\x80\x02" + body(pkl) + op_str(key) + value_ops + b"s."


def prepend(pkl: bytes, ops: bytes) -> bytes:
    """Run ``ops`` (and drop their result) before the original object is built."""
    return b"\x80\x02" + ops + b"0" + body(pkl) + b"."


# ---- torch zip rewriting -------------------------------------------------------------------------
_AUTO = {".format_version", ".storage_alignment", "byteorder", "version", ".data/serialization_id"}


def rewrite_pkl(path: Path, transform: Callable[[bytes], bytes]) -> None:
    """Replace ``data.pkl`` of the torch zip archive ``path`` by ``transform(old)``, in place, keeping every
    tensor record (re-aligned by torch's own archive writer)."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        prefix = next(n for n in names if n.endswith("data.pkl"))[: -len("data.pkl")]
        records = [(n[len(prefix) :], zf.read(n)) for n in names]
    # torch names the archive folder after the file's stem: stage under the same name in a side folder
    stage_dir = path.with_name(path.name + ".rewrite.d")
    stage_dir.mkdir()
    target = stage_dir / path.name
    w = torch._C.PyTorchFileWriter(str(target))
    for rel, data in records:
        if rel in _AUTO:
            continue
        if rel == "data.pkl":
            data = transform(data)
        w.write_record(rel, data, len(data))
    w.write_end_of_file()
    del w
    os.replace(target, path)
    stage_dir.rmdir()


def read_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("data.pkl"))
        return zf.read(name)


def files_of(folder: Path, patterns: Sequence[str]) -> list[Path]:
    return sorted(p for pat in patterns for p in folder.rglob(pat))
