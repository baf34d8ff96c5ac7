"""Publishing an output into an object store (``s3://``), where nothing can be renamed.

``zckpt.storage.staging.Staging`` hands a URL destination to ``RemoteStaging``, which keeps ``Staging``'s
contract (writers put files under ``.dir`` by their final names; ``commit()`` publishes; leaving the ``with``
block without it leaves nothing) with a store's means:

- ``.dir`` is a small local folder registered, in the running operation's ``zckpt.storage.session.Storage``
  (``stand_ins``), as the stand-in of the destination. A tensor file written there through ``HashingSink``
  is not written locally: ``target(path)`` maps it to its final key and the sink streams it as a multipart
  upload (``objstore.Upload``), visible only once complete. Only the code that made the folder registers
  it: no file found on disk ever decides where an output goes. The objects that make a checkpoint
  complete (``PublishOrder``, from the formats: the HF index, ``manifest.json``, DCP's ``.metadata``,
  ``latest``), the sidecars and the small files (config, ``latest``) stay in the local
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

Several nodes (torchrun): rank 0 sends the other ranks a ``Ticket`` (its folder, the destination, and a
random token it wrote in the folder, ``HOST_TOKEN``). A rank that finds that folder holding that token is on
rank 0's host: it registers the folder as the same stand-in in its own ``Storage`` and writes into it. A rank
on another host writes into a ``Follower``: a stand-in of its own for the same destination, whose data files
stream the same way; ``flush()`` uploads its small files (sidecars) and returns what it uploaded, which rank
0 ``adopt``s before it publishes; an error deletes what the follower uploaded.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from zckpt.errors import OutputExists, StorageError
from zckpt.storage import interrupts, objstore, session
from zckpt.storage.digest import SIDECARS

HOST_TOKEN = ".zckpt-host-token"
"""In ``.dir``: a random token rank 0 also sends in its ``Ticket``; a rank that reads the same token there is
on rank 0's host (it says nothing about where anything goes)."""
UPLOADS = ".zckpt-uploads"
"""In ``.dir``: the URLs uploaded so far, one a line, appended by every process writing there."""


@dataclass(frozen=True)
class PublishOrder:
    """Which files of an output complete it (uploaded after every data object) and which point at it
    (``latest``: uploaded last of all); everything else is data, streamed as it is written. The formats
    say which names these are (``zckpt.formats.PUBLISH_ORDER``): this module knows no file name."""

    completing: re.Pattern[str]
    pointer: re.Pattern[str]

    def rank(self, rel: str) -> int:
        """0: data, 1: completing, 2: pointer."""
        return 2 if self.pointer.search(rel) else 1 if self.completing.search(rel) else 0


_lock = threading.Lock()
"""Serialises appends to a stand-in folder's ``UPLOADS`` list between this process's threads."""


@dataclass(frozen=True)
class Ticket:
    """What rank 0 sends the other ranks of a split job about its stand-in folder (see the module doc)."""

    folder: str
    url: str
    is_dir: bool
    token: str
    order: PublishOrder
    generation: str | None = None
    """The name part of the output's data objects (``RemoteStaging.generation``)."""


def new_generation() -> str:
    """A fresh generation name: ``g`` and 16 hex digits (64 random bits)."""
    return f"g{secrets.token_hex(8)}"


def _bookkeeping(name: str) -> bool:
    """A stand-in folder's own files (the host token, the upload list): never uploaded."""
    return name in (HOST_TOKEN, UPLOADS)


@dataclass
class StandIn:
    """A local folder's registration as the stand-in of ``url``. ``aborted`` (under ``lock``): the output
    is being given up; an object whose upload would complete after that is aborted instead (``completing``),
    so none appears once the abort has listed what to delete."""

    url: str
    is_dir: bool
    order: PublishOrder
    lock: threading.Lock = field(default_factory=threading.Lock)
    aborted: bool = False


def register(folder: Path, url: str, is_dir: bool, order: PublishOrder) -> bool:
    """Make ``folder`` the stand-in of ``url`` for the running operation (``Storage.stand_ins``); False
    when it is one already (rank 0's own, in its own process)."""
    st = session.current()
    key = Path(os.path.abspath(folder))
    with st.lock:
        if isinstance(st.stand_ins.get(key), StandIn):
            return False
        st.stand_ins[key] = StandIn(url, is_dir, order)
        return True


def unregister(folder: Path) -> None:
    st = session.bound_storage()
    if st is not None:
        with st.lock:
            st.stand_ins.pop(Path(os.path.abspath(folder)), None)


def _new_stand_in(url: str, is_dir: bool, order: PublishOrder) -> tuple[Path, str]:
    """A fresh local folder registered as the stand-in of ``url``, and the host token written in it."""
    folder = Path(tempfile.mkdtemp(prefix="zckpt-s3-staging-"))
    token = secrets.token_hex(16)
    (folder / HOST_TOKEN).write_text(token)
    register(folder, url, is_dir, order)
    return folder, token


def _registered(folder: Path) -> StandIn | None:
    st = session.bound_storage()
    if st is None:
        return None
    with st.lock:
        got = st.stand_ins.get(folder)
    return got if isinstance(got, StandIn) else None


def _find(path: Path) -> tuple[Path, StandIn] | None:
    p = Path(os.path.abspath(path))
    for d in list(p.parents)[:4]:
        m = _registered(d)
        if m is not None:
            return d, m
    return None


def target(path: Path) -> tuple[Path, str] | None:
    """(stand-in folder, the URL) that a file about to be written at ``path`` stands for, when ``path`` lies
    in a folder the running operation registered as a stand-in; None for an ordinary local file."""
    found = _find(path)
    if found is None:
        return None
    d, m = found
    rel = Path(os.path.abspath(path)).relative_to(d).as_posix()
    base = m.url if m.is_dir else m.url.rsplit("/", 1)[0]
    return d, f"{base}/{rel}"


@contextlib.contextmanager
def completing(path: Path) -> Iterator[bool]:
    """Around the completion of ``path``'s object: yields whether it may complete (its output is not being
    given up); the abort waits for a completion in progress, and a completion after it is refused."""
    found = _find(path)
    if found is None:
        yield True
        return
    with found[1].lock:
        yield not found[1].aborted


def give_up(folder: Path) -> None:
    """Mark the stand-in ``folder`` aborted: no object of it completes from now on (``completing``)."""
    m = _registered(Path(os.path.abspath(folder)))
    if m is not None:
        with m.lock:
            m.aborted = True


def streamed(path: Path) -> str | None:
    """The URL to stream ``path`` to (a data file of a remote staging folder), or None: a local file."""
    t, found = target(path), _find(path)
    if t is None or found is None or found[1].order.rank(t[1]) > 0:
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
        order: PublishOrder,
    ) -> None:
        """``order``: which files complete the output (``PublishOrder``). ``owns``/``foreign``: as for
        ``Staging`` (an earlier folder's objects that are not this output's own are kept, or the run is
        refused naming them)."""
        self.dest = objstore.RemotePath.of(dest)
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
        self.order = order
        self.dir, self.token = _new_stand_in(self.url, is_dir, order)
        interrupts.opened(self)
        self._old: list[str] = []
        self.kept: list[str] = []
        """Top-level names of an earlier ``dest`` that stay (objects zckpt did not write)."""
        self.generation = new_generation() if overwrite and kind == "dir" else None
        """Replacing a folder: the new output's data objects carry this in their names (a writer that can:
        ``CheckpointWriter.generations``), so that the previous output stays whole until the completing
        object that names them replaces its own; None: a new output, or a single object (replaced whole)."""
        self._sidecars: dict[str, bytes] = {}
        """Sidecars of objects this output replaces, taken away before the new objects land, restored by an
        abort (``expect``)."""
        if overwrite and kind == "dir":
            self._old = objstore.list_keys(self.url)
            if owns is not None:  # never delete an object zckpt did not write
                theirs = [u for u in self._old if not owns(u[len(self.url) + 1 :])]
                if theirs and foreign == "refuse":
                    self._release()
                    interrupts.closed(self, published=False)
                    shown = ", ".join(u.rsplit("/", 1)[1] for u in theirs[:5])
                    raise OutputExists(f"{self.url} holds objects zckpt did not write ({shown})",
                                       hint="give another DST, or move them away", path=self.url)  # fmt: skip
                self._old = [u for u in self._old if owns(u[len(self.url) + 1 :])]
                self.kept = sorted({u[len(self.url) + 1 :].split("/", 1)[0] for u in theirs})
        self._done = False

    def __enter__(self) -> RemoteStaging:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._done:
            self.abort()

    def expect(self, names: list[str]) -> None:
        """The output's data objects will have these names (relative to its folder): refuse those that exist
        unless overwriting; when overwriting, take away the sidecars of those that exist (kept here, put
        back by an abort), so that no old sidecar ever sits beside a new object: an object is replaced
        whole, and until then it keeps no sidecar of the other one's bytes."""
        base = self._base()
        for n in names:
            if objstore.kind(f"{base}/{n}") is None:
                continue
            if not self.overwrite and not self.is_dir:
                raise OutputExists(f"{base}/{n} already exists", hint="pass --overwrite to replace it",
                                   path=f"{base}/{n}")  # fmt: skip
            for side in SIDECARS:
                u = f"{base}/{n}{side}"
                if objstore.kind(u) == "file":
                    with objstore.open_read(u) as f:
                        self._sidecars[u] = f.read(1 << 20)
                    objstore.delete([u])

    def adopt(self, urls: list[str]) -> None:
        """Objects other hosts' ranks uploaded for this output (``Follower.flush``): deleted by an abort,
        listed by ``commit``."""
        with _lock, open(self.dir / UPLOADS, "a") as f:
            f.writelines(u + "\n" for u in urls)

    def _uploaded(self) -> list[str]:
        f = self.dir / UPLOADS
        return f.read_text().split() if f.is_file() else []

    def abort(self) -> None:
        """Stop any object of it from completing, delete every object this output uploaded, put back the
        sidecars ``expect`` took away, and remove the local folder. What could not be deleted is named in
        the running operation's ``Storage.left`` (the CLI says so)."""
        give_up(self.dir)
        gone = self._uploaded()
        try:
            objstore.delete(gone)
            for u, data in self._sidecars.items():
                objstore.put_bytes(u, data)
        except StorageError:
            session.current().left.extend(gone)
            raise
        finally:
            self._release()
            self._done = True
            interrupts.closed(self, published=False)

    def ticket(self) -> Ticket:
        """What the other ranks of a split job need to write their share (``staging.share``)."""
        return Ticket(str(self.dir), self.url, self.is_dir, self.token, self.order, self.generation)

    def _release(self) -> None:
        unregister(self.dir)
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

    def commit(self) -> list[objstore.RemotePath]:
        """Upload the local files (data, then completing objects, then ``latest``); returns the outputs.
        Once a completing object has landed the new output is whole: a later failure (``latest``, the
        deletion of superseded objects) never deletes it, and says so."""
        base = self._base()
        rank = self.order.rank
        for rel in sorted(self._local(), key=lambda r: (rank(r), r)):
            url = f"{base}/{rel}"
            try:
                with interrupts.held():  # Ctrl-C waits while it lands and is noted (an abort deletes it)
                    objstore.upload_file(self.dir / rel, url, create=rank(rel) > 0 and not self.overwrite)
                    record(self.dir / rel, url)
            except StorageError as e:
                if not self._done:
                    raise
                self._release()
                raise StorageError(f"{self.url}: published whole, but writing {rel} failed ({e})",
                                   hint=e.hint, path=self.url) from e  # fmt: skip
            if rank(rel) == 1 and not self._done:  # the new output is whole from here on
                self._done = True
                interrupts.closed(self, published=True)
        written = sorted(set(self._uploaded()))
        if self.overwrite:
            keep = set(written)
            stale = [u for u in self._old if u not in keep]
            if not self.is_dir:
                stem = self.url.rsplit("/", 1)[1].partition(".")[0]
                rx = re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.")
                stale = [u for u in objstore.list_keys(base, recursive=False)
                         if rx.match(u.rsplit("/", 1)[1]) and u not in keep]  # fmt: skip
            try:
                objstore.delete(stale)
            except StorageError as e:
                warnings.warn(f"{self.url}: published; the previous output's objects were not all deleted "
                              f"({e})", stacklevel=3)  # fmt: skip
        self._release()
        if not self._done:
            interrupts.closed(self, published=True)
        self._done = True
        return [objstore.RemotePath.of(u) for u in written]


def on_this_host(t: Ticket) -> bool:
    """Whether rank 0's stand-in folder of ``t`` is here (it holds ``t``'s token): ranks of rank 0's host
    write into it; a rank on another node writes into a ``Follower``."""
    try:
        return (Path(t.folder) / HOST_TOKEN).read_text() == t.token
    except OSError:
        return False


class Follower(RemoteStaging):
    """A rank's share of ``RemoteStaging`` output on another host (see the module doc): a marked stand-in of
    its own; ``flush()`` uploads its small files and returns every URL it uploaded; leaving the ``with`` block
    without it deletes them."""

    def __init__(
        self, url: str, *, is_dir: bool, order: PublishOrder
    ) -> None:  # no checks: rank 0's made them
        self.url, self.dest, self.is_dir, self.overwrite = url, objstore.RemotePath.of(url), is_dir, True
        self.owns, self._old, self.kept, self._done = None, [], [], False
        self.generation, self._sidecars, self.order = None, {}, order
        self.dir, self.token = _new_stand_in(url, is_dir, order)

    def flush(self) -> list[str]:
        base = self._base()
        for rel in self._local():
            if self.order.rank(rel) > 0:  # rank 0 writes those, last
                raise RuntimeError(f"{rel}: a completing object written off rank 0")
            with interrupts.held():
                objstore.upload_file(self.dir / rel, f"{base}/{rel}", create=False)
                record(self.dir / rel, f"{base}/{rel}")
        urls = self._uploaded()
        self._release()
        self._done = True
        return urls


def stand_in(dest: str | objstore.RemotePath, order: PublishOrder) -> Ticket:
    """A fresh local folder standing for the folder ``dest`` (a URL) in one engine save, registered for the
    running operation: data files written in it stream to ``dest`` (``streamed``), the rest is uploaded by
    ``publish_dir``. Rank 0 makes it and sends the ``Ticket`` to the other ranks (``join``)."""
    url = str(objstore.RemotePath.of(dest))
    folder, token = _new_stand_in(url, True, order)
    return Ticket(str(folder), url, True, token, order)


def join(t: Ticket) -> Path:
    """This rank's folder for rank 0's stand-in ``t``: rank 0's own folder when it is on this host
    (registered for this operation too), else a fresh stand-in of its own for the same destination."""
    if on_this_host(t):
        register(Path(t.folder), t.url, t.is_dir, t.order)
        return Path(t.folder)
    return Path(stand_in(t.url, t.order).folder)


@dataclass(frozen=True)
class Published:
    """What ``publish_dir`` did: the objects that make the save (``written``), the superseded ones it
    deleted, and those it could not delete (left for the next save of the folder, which deletes them)."""

    written: list[str]
    deleted: list[str]
    left: list[str]


def publish_dir(
    folder: Path,
    dest: str | objstore.RemotePath,
    order: PublishOrder,
    superseded: Callable[[str], bool],
    also: list[str] | None = None,
) -> Published:
    """Publish a stand-in folder of a save whose data objects went to keys no earlier save used (a fresh
    generation in their names, ``zckpt.formats.native.layout.rank_file``), so nothing of the previous save
    was touched while they uploaded. Its local files (sidecars, then the completing object, ``manifest.json``,
    which names the new data objects) are uploaded, each replacing its namesake in one PUT: the moment the
    completing object lands, readers see the new save whole; before it, the previous one whole. Then the
    objects of ``dest`` that ``superseded(key relative to dest)`` claims (earlier saves' data and sidecars,
    a killed writer's leftovers) and that this save did not write are deleted; a failure there is left for
    the next save (``Published.left``), never an error. ``also``: the objects other nodes' ranks uploaded.
    The folder is removed."""
    url = str(objstore.RemotePath.of(dest))
    base_len = len(url) + 1
    with open(folder / UPLOADS, "a") as f:
        f.writelines(u + "\n" for u in also or [])
    local = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and not _bookkeeping(p.name)
    )
    uploads = folder / UPLOADS
    for rel in sorted(local, key=lambda r: (order.rank(r), r)):
        with interrupts.held(), _lock:  # Ctrl-C waits while it lands and is noted (a failed save deletes it)
            objstore.upload_file(folder / rel, f"{url}/{rel}")
            with open(uploads, "a") as f:
                f.write(f"{url}/{rel}\n")
    written = sorted(set(uploads.read_text().split()))
    unregister(folder)
    shutil.rmtree(folder, ignore_errors=True)
    keep = set(written)
    try:
        stale = [u for u in objstore.list_keys(url) if u not in keep and superseded(u[base_len:])]
        objstore.delete(stale)
    except StorageError:
        return Published(written, [], ["(listing or deleting superseded objects failed)"])
    return Published(written, stale, [])


def discard_dir(folder: Path, also: list[str] | None = None) -> None:
    """A failed save: delete what its ranks uploaded (those of this host, listed in the folder, and ``also``:
    other nodes' objects), remove the stand-in folder."""
    f = folder / UPLOADS
    with contextlib.suppress(StorageError):
        objstore.delete(sorted(set((f.read_text().split() if f.is_file() else []) + (also or []))))
    unregister(folder)
    shutil.rmtree(folder, ignore_errors=True)
