#!/usr/bin/env python3
"""Issue 22's next step, measured before it is built: can a DCP ``.metadata`` load hide under
``import torch``?

A prototype, not product code. ``serial`` is what zckpt does today: ``import torch``, then
``zckpt.formats.dcp.metadata.load_metadata``. ``fork`` forks a child before ``import torch``; the child runs
the torch-free part of a ``.metadata`` load (zckpt's prescan, a C unpickle whose torch globals are plain
stand-ins: ``torch.Size`` a tuple, dtypes their names) and sends back the tensors' and items' records as
marshal'd tuples, while the parent imports torch and then rebuilds the records with torch dtypes. The child
skips zckpt's graph check and parse checks, which a product version would run there too (both torch-free
work, so they would hide under the import as well). Each mode runs in a fresh process, alternating.

    python bench/fork_open.py DCP_FOLDER [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import json
import marshal
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class _Rec:
    """A DCP dataclass's stand-in: its pickled state kept as attributes."""

    def __setstate__(self, st: Any) -> None:
        if isinstance(st, tuple) and len(st) == 5:  # TensorProperties
            st = dict(
                zip(("dtype", "layout", "requires_grad", "memory_format", "pin_memory"), st, strict=True)
            )
        self.__dict__.update(st if isinstance(st, dict) else {})


class _Index(_Rec):
    """``MetadataIndex``: hashable by fqn and offset, as DCP's."""

    def _key(self) -> tuple[Any, Any]:
        off = self.__dict__.get("offset")
        return (self.__dict__.get("fqn"), tuple(off) if isinstance(off, (list, tuple)) else off)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Index) and self._key() == other._key()


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch":
            return tuple if name == "Size" else name  # a dtype: its name
        if name == "MetadataIndex":
            return _Index
        if name in ("_MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING"):
            return int
        if name == "_get_layout":
            return str
        if module == "pathlib":
            return lambda *parts: "/".join(parts)
        return type(name, (_Rec,), {})


def _child(data: bytes) -> bytes:
    sys.path.insert(0, str(ROOT))
    from zckpt.io.pickle_scan import prescan  # torch-free

    prescan(data, ".metadata", 1 << 20)
    md = _Unpickler(io.BytesIO(data)).load()
    tensors = tuple(
        (fqn, m.properties.dtype, tuple(m.size), tuple((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks))
        for fqn, m in md.state_dict_metadata.items()
        if "chunks" in m.__dict__
    )
    items = tuple(
        (k.fqn, None if k.offset is None else tuple(k.offset), v.relative_path, v.offset, v.length)
        for k, v in md.storage_data.items()
    )
    return marshal.dumps((tensors, items))


def run_fork(folder: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    data = (folder / ".metadata").read_bytes()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never imports torch
        os.close(r)
        with os.fdopen(w, "wb") as out:
            out.write(_child(data))
        os._exit(0)
    os.close(w)
    import torch

    t_torch = time.perf_counter() - t0
    with os.fdopen(r, "rb") as inp:
        blob = inp.read()
    os.waitpid(pid, 0)
    tensors, items = marshal.loads(blob)
    dtypes = {n: v for n, v in vars(torch).items() if isinstance(v, torch.dtype)}
    built = {fqn: (dtypes[d], size, chunks) for fqn, d, size, chunks in tensors}
    where = {(fqn, off): (f, o, n) for fqn, off, f, o, n in items}
    assert built and where
    return {"torch_s": t_torch, "done_s": time.perf_counter() - t0}


def run_serial(folder: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    import torch  # noqa: F401

    t_torch = time.perf_counter() - t0
    sys.path.insert(0, str(ROOT))
    from zckpt.formats.dcp.metadata import load_metadata

    load_metadata(folder)
    return {"torch_s": t_torch, "done_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mode", choices=("serial", "fork"), help=argparse.SUPPRESS)  # one run, in a child
    a = ap.parse_args()
    if a.mode:
        print(json.dumps((run_fork if a.mode == "fork" else run_serial)(a.folder)))
        return
    got: dict[str, list[dict[str, float]]] = {"serial": [], "fork": []}
    for _ in range(a.repeat):
        for mode in got:
            out = subprocess.run(
                [sys.executable, __file__, str(a.folder), "--mode", mode],
                check=True,
                capture_output=True,
                text=True,
            )
            got[mode].append(json.loads(out.stdout))
    for mode, runs in got.items():
        med = statistics.median(r["done_s"] for r in runs)
        each = " ".join(f"{r['done_s']:.2f}" for r in runs)
        torch_s = " ".join(f"{r['torch_s']:.2f}" for r in runs)
        print(
            f"FORKOPEN {mode}: .metadata loaded at {med:.2f} s (runs {each}; import torch done at {torch_s})"
        )


if __name__ == "__main__":
    main()
