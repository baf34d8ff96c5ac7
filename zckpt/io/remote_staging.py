"""Publishing an output into an object store (``s3://``), where nothing can be renamed.

``zckpt.io.staging.Staging`` hands a URL destination to ``RemoteStaging``, which keeps ``Staging``'s contract
(writers put files under ``.dir`` by their final names; ``commit()`` publishes; leaving the ``with`` block
without it leaves nothing) with a store's means:

- ``.dir`` is a small local folder marked as the stand-in of the destination (``MARKER``). A tensor file
  written there through ``HashingSink`` is not written locally: ``target(path)`` maps it to its final key
  and the sink streams it as a multipart upload (``objstore.Upload``), visible only once complete. The
  objects that make a checkpoint complete (``COMPLETING``: the HF index, ``manifest.json``, DCP's
  ``.metadata``, ``latest``), the sidecars and the small files (config, ``latest``) stay in the local
  folder: they are KBs.
- ``commit()`` uploads the local files, the completing ones last and ``latest`` very last, with
  create-if-absent (``If-None-Match: *``) unless overwriting; a single-file output is its own completing
  object. With ``--overwrite``, the old completing objects are deleted first (so the old checkpoint stops
  looking complete before its data is replaced), and old objects the new output does not have are deleted
  after it is published.
- ``abort()`` (an error, Ctrl-C): in-flight uploads are aborted by their sinks; every object already
  uploaded (this process's and, on the same host, other ranks', listed in ``UPLOADS``, and other hosts'
  that ``adopt`` named) is deleted. A SIGKILL leaves at most uploaded data objects and incomplete multipart
  uploads, never a completing object without its data.

Several nodes (torchrun): ranks on rank 0's host write into its folder. A rank on another host, where that
folder is not, writes into a ``Follower``: a stand-in of its own for the same destination, whose data files
stream the same way; ``flush()`` uploads its small files (sidecars) and returns what it uploaded, which rank
0 ``adopt``s before it publishes; an error deletes what the follower uploaded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from zckpt.errors import OutputExists, StorageError
from zckpt.io import objstore

MARKER = ".zckpt-remote.json"
"""In ``.dir``: the destination URL and whether it is a folder (other ranks on the host read it)."""
UPLOADS = ".zckpt-uploads"
"""In ``.dir``: the URLs uploaded so far, one a line, appended by every process writing there."""
COMPLETING = re.compile(r"(^|/)(manifest\.json|\.metadata|[^/]*\.index\.json)$")
"""Objects that make a checkpoint look complete: published after every data object."""
LATEST = re.compile(r"(^|/)latest$")
"""Published last of all."""

_lock = threading.Lock()
_marked: dict[Path, tuple[str, bool]] = {}


def _bookkeeping(name: str) -> bool:
    """A stand-in folder's own files (the marker, its temporary copy, the upload list): never uploaded."""
    return name.startswith(MARKER) or name == UPLOADS


def _write_marker(folder: Path, url: str, is_dir: bool) -> None:
    """Mark ``folder`` as the stand-in of ``url``. The marker appears whole (written aside, then renamed): the
    ranks of a node may mark the same folder at once."""
    tmp = folder / f"{MARKER}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_text(json.dumps({"dest": url, "is_dir": is_dir}))
    os.replace(tmp, folder / MARKER)


def _new_stand_in(url: str, is_dir: bool) -> Path:
    """A fresh local folder marked as the stand-in of ``url`` (known to this process without reading it)."""
    folder = Path(tempfile.mkdtemp(prefix="zckpt-s3-staging-"))
    _write_marker(folder, url, is_dir)
    with _lock:
        _marked[folder] = (url, is_dir)
    return folder


def _marker(folder: Path) -> tuple[str, bool] | None:
    hit = _marked.get(folder)
    if hit is not None:
        return hit
    m = folder / MARKER
    if m.is_file():
        d = json.loads(m.read_text())
        return str(d["dest"]), bool(d["is_dir"])
    return None


def target(path: Path) -> tuple[Path, str] | None:
    """(staging folder, the URL) that a file about to be written at ``path`` stands for, when ``path`` lies
    in a ``RemoteStaging`` folder; None for an ordinary local file."""
    p = Path(os.path.abspath(path))
    for d in list(p.parents)[:4]:
        m = _marker(d)
        if m is not None:
            dest, is_dir = m
            rel = p.relative_to(d).as_posix()
            base = dest if is_dir else dest.rsplit("/", 1)[0]
            return d, f"{base}/{rel}"
    return None


def streamed(path: Path) -> str | None:
    """The URL to stream ``path`` to (a data file of a remote staging folder), or None: a local file."""
    t = target(path)
    if t is None or COMPLETING.search(t[1]) or LATEST.search(t[1]):
        return None
    return t[1]


def record(path: Path, url: str) -> None:
    """Note that ``url`` (written for ``path``) exists now: an abort deletes it."""
    t = target(path)
    if t is not None:
        with _lock, open(t[0] / UPLOADS, "a") as f:
            f.write(url + "\n")


class RemoteStaging:
    """``Staging`` for a destination in an object store (see the module doc)."""

    def __init__(
        self,
        dest: Any,
        *,
        is_dir: bool,
        overwrite: bool = False,
        owns: Callable[[str], bool] | None = None,
        foreign: str = "keep",
    ) -> None:
        """``owns``/``foreign``: as for ``Staging`` (an earlier folder's objects that are not this output's
        own are kept, or the run is refused naming them)."""
        self.dest = objstore.as_path(dest)
        self.url = str(self.dest)
        self.owns = owns
        self.is_dir = is_dir
        self.overwrite = overwrite
        kind = objstore.kind(self.url)
        if kind is not None:
            if not overwrite:
                raise OutputExists(f"{self.url} already exists", hint="pass --overwrite to replace it",
                                   path=self.url)  # fmt: skip
            if (kind == "dir") != is_dir:
                have, want = ("a folder" if k else "a file" for k in (kind == "dir", is_dir))
                raise OutputExists(
                    f"{self.url} is {have}; refusing to replace it by {want}",
                    hint="remove it first or choose another output path",
                    path=self.url,
                )
        self.dir = _new_stand_in(self.url, is_dir)
        self._old: list[str] = []
        self.kept: list[str] = []
        """Top-level names of an earlier ``dest`` that stay (objects zckpt did not write)."""
        if overwrite and kind == "dir":
            self._old = objstore.list_keys(self.url)
            if owns is not None:  # never delete an object zckpt did not write
                theirs = [u for u in self._old if not owns(u[len(self.url) + 1 :])]
                if theirs and foreign == "refuse":
                    self._release()
                    shown = ", ".join(u.rsplit("/", 1)[1] for u in theirs[:5])
                    raise OutputExists(f"{self.url} holds objects zckpt did not write ({shown})",
                                       hint="give another DST, or move them away", path=self.url)  # fmt: skip
                self._old = [u for u in self._old if owns(u[len(self.url) + 1 :])]
                self.kept = sorted({u[len(self.url) + 1 :].split("/", 1)[0] for u in theirs})
            objstore.delete([u for u in self._old if COMPLETING.search(u) or LATEST.search(u)])
        self._done = False

    def __enter__(self) -> RemoteStaging:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done:
            self.abort()

    def expect(self, names: list[str]) -> None:
        if not self.is_dir and not self.overwrite:
            base = self.url.rsplit("/", 1)[0]
            for n in names:
                if objstore.kind(f"{base}/{n}") is not None:
                    raise OutputExists(f"{base}/{n} already exists", hint="pass --overwrite to replace it",
                                       path=f"{base}/{n}")  # fmt: skip

    def adopt(self, urls: list[str]) -> None:
        """Objects other hosts' ranks uploaded for this output (``Follower.flush``): deleted by an abort,
        listed by ``commit``."""
        with _lock, open(self.dir / UPLOADS, "a") as f:
            f.writelines(u + "\n" for u in urls)

    def _uploaded(self) -> list[str]:
        f = self.dir / UPLOADS
        return f.read_text().split() if f.is_file() else []

    def abort(self) -> None:
        """Delete every object this output uploaded, and the local folder."""
        try:
            objstore.delete(self._uploaded())
        finally:
            self._release()
            self._done = True

    def _release(self) -> None:
        with _lock:
            _marked.pop(self.dir, None)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _base(self) -> str:
        """The folder URL the local files' relative paths are under."""
        return self.url if self.is_dir else self.url.rsplit("/", 1)[0]

    def _local(self) -> list[str]:
        """The files written into the local folder (not its bookkeeping), as paths relative to it, sorted."""
        return sorted(
            p.relative_to(self.dir).as_posix()
            for p in self.dir.rglob("*")
            if p.is_file() and not _bookkeeping(p.name)
        )

    def commit(self) -> list[Any]:
        """Upload the local files (data, then completing objects, then ``latest``); returns the outputs."""
        base = self._base()

        def rank(rel: str) -> int:
            return 2 if LATEST.search(rel) else 1 if COMPLETING.search(rel) else 0

        for rel in sorted(self._local(), key=lambda r: (rank(r), r)):
            url = f"{base}/{rel}"
            objstore.upload_file(self.dir / rel, url, create=rank(rel) > 0 and not self.overwrite)
            record(self.dir / rel, url)
        written = sorted(set(self._uploaded()))
        if self.overwrite:
            keep = set(written)
            stale = [u for u in self._old if u not in keep]
            if not self.is_dir:
                stem = self.url.rsplit("/", 1)[1].partition(".")[0]
                rx = re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.")
                stale = [u for u in objstore.list_keys(base, recursive=False)
                         if rx.match(u.rsplit("/", 1)[1]) and u not in keep]  # fmt: skip
            objstore.delete(stale)
        self._release()
        self._done = True
        return [objstore.as_path(u) for u in written]


def on_this_host(folder: Path, url: str) -> bool:
    """Whether ``folder`` (rank 0's staging folder) is here, standing for ``url``: ranks of rank 0's host
    write into it; a rank on another node writes into a ``Follower``."""
    m = _marker(folder)
    return m is not None and m[0] == url


class Follower(RemoteStaging):
    """A rank's share of ``RemoteStaging`` output on another host (see the module doc): a marked stand-in of
    its own; ``flush()`` uploads its small files and returns every URL it uploaded; leaving the ``with`` block
    without it deletes them."""

    def __init__(self, url: str, *, is_dir: bool) -> None:  # no checks: rank 0's RemoteStaging made them
        self.url, self.dest, self.is_dir, self.overwrite = url, objstore.as_path(url), is_dir, True
        self.owns, self._old, self.kept, self._done = None, [], [], False
        self.dir = _new_stand_in(url, is_dir)

    def flush(self) -> list[str]:
        base = self._base()
        for rel in self._local():
            if COMPLETING.search(rel) or LATEST.search(rel):  # rank 0 writes those, last
                raise RuntimeError(f"{rel}: a completing object written off rank 0")
            objstore.upload_file(self.dir / rel, f"{base}/{rel}", create=False)
            record(self.dir / rel, f"{base}/{rel}")
        urls = self._uploaded()
        self._release()
        self._done = True
        return urls


def local_stand_in(dest: str | os.PathLike[str]) -> Path:
    """A local folder that stands for the folder ``dest`` (a URL) in one save: the same path on every
    process of the host (derived from the URL), so ranks that compute it independently agree."""
    import hashlib

    h = hashlib.sha256(str(objstore.as_path(dest)).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"zckpt-s3-save-{h}"


def mark(folder: Path, dest: str | os.PathLike[str]) -> None:
    """Make ``folder`` (fresh, local) the stand-in of the folder ``dest``: data files written in it are
    streamed to ``dest`` (``streamed``), the rest uploaded by ``publish_dir``."""
    _write_marker(folder, str(objstore.as_path(dest)), True)


def publish_dir(folder: Path, dest: str | os.PathLike[str], also: list[str] | None = None) -> None:
    """Publish a marked stand-in folder: its local files uploaded (completing ones last), replacing what
    was there; old objects under ``dest`` that this save did not write (this host's ranks, listed in the
    folder, and ``also``: other nodes' ranks) are deleted; the folder removed."""
    url = str(objstore.as_path(dest))
    old = objstore.list_keys(url) if objstore.kind(url) is not None else []
    objstore.delete([u for u in old if COMPLETING.search(u) or LATEST.search(u)])
    st = RemoteStaging.__new__(RemoteStaging)
    st.url, st.dest, st.is_dir, st.overwrite, st.dir, st._old, st._done = (
        url, objstore.as_path(url), True, True, folder, old, False,
    )  # fmt: skip
    st.adopt(also or [])
    st.commit()


def discard_dir(folder: Path, also: list[str] | None = None) -> None:
    """A failed save: delete what its ranks uploaded (those of this host, listed in the folder, and ``also``:
    other nodes' objects), remove the stand-in folder."""
    f = folder / UPLOADS
    with contextlib.suppress(StorageError):
        objstore.delete(sorted(set((f.read_text().split() if f.is_file() else []) + (also or []))))
    shutil.rmtree(folder, ignore_errors=True)
