"""Integrity findings and checksums: the vocabulary ``verify`` and every format's ``verify`` hook share.

``Problem`` is one thing wrong with one file; ``VerifyContext`` carries what one verify run accumulates
(the checksums compared, each file's sha256 computed once, pickles already parsed, files already found
broken). Checksums: the sidecars beside a file (``<file>.crc32.json`` block CRC-32s, which zckpt writes;
``<file>.sha256.json`` block sha256s of earlier versions; ``<file>.sha256`` in ``sha256sum`` format) and
digests recorded by a format's own manifest, compared through ``compare_sha`` (whole file) or
``compare_digest`` (whole file or per block). ``VerifyContext.sha256`` also computes a file's whole sha256
on request (``verify --sha256``).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from zckpt.errors import (
    CorruptCheckpoint,
    KeyMappingError,
    ShardMismatch,
    UnknownFormat,
    UnsafePickle,
    Unsupported,
    ZckptError,
)
from zckpt.model import Checked
from zckpt.storage import fileio
from zckpt.storage.crc_pieces import CrcPieces
from zckpt.storage.digest import (
    BLOCK_SIDECAR,
    CRC_SIDECAR,
    CRC_SIDECAR_FORMAT,
    CRC_SIDECAR_VERSION,
    WHOLE_SIDECAR,
    FileDigest,
    block_digests,
)
from zckpt.storage.digest import SIDECARS as SIDECARS  # re-exported: every sidecar suffix
from zckpt.storage.location import Location, lexists, ordered, resolved
from zckpt.storage.location import size as size_of
from zckpt.storage.scan import Scanner, Segment, sha256_file

SIDECAR = WHOLE_SIDECAR


def sidecar_suffix(name: str) -> str:
    """The sidecar suffix ``name`` ends with, or ``""`` when it is no sidecar."""
    return next((s for s in SIDECARS if name.endswith(s)), "")


KINDS = ("missing", "truncated", "corrupt", "checksum", "stale", "inconsistent", "unsupported", "unsafe")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one file. ``str(problem)`` is the one-line report."""

    file: str
    message: str
    kind: str
    hint: str | None = None

    def __str__(self) -> str:
        return f"{self.file}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "message": self.message, "kind": self.kind, "hint": self.hint}


@dataclass
class VerifyContext:
    """State of one verify run (see the module doc)."""

    trust: bool = False
    tag: str | None = None
    checksums: int = 0
    hashes: dict[str, str] = field(default_factory=dict)
    pickles: dict[str, Any] = field(default_factory=dict)
    """Top-level objects of the torch zip files already parsed (for cross-file checks)."""
    broken: set[str] = field(default_factory=set)
    """Files already reported as structurally broken: their checksums are not compared too."""
    scanner: Scanner | None = None
    """The run's scan threads (``zckpt.storage.scan``): files are checked side by side, big records in
    pieces."""
    crc_pieces: CrcPieces = field(init=False, repr=False)
    """Record CRCs kept for the block CRCs of the same file (``cut_at_blocks``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.crc_pieces = CrcPieces(self._crc_ranges, self._crc_segments)

    def sha256(self, f: Location) -> str:
        """The file's sha256, computed once however many records (sidecar, manifest) name it."""
        key = str(f)
        if self.scanner is not None:
            return self.scanner.sha256(key).result()
        if key not in self.hashes:
            self.hashes[key] = sha256_file(f)
        return self.hashes[key]

    def count(self, n: int) -> None:
        """``n`` more checksums compared (thread-safe)."""
        with self._lock:
            self.checksums += n

    def crc_ranges(self, f: Location, ranges: list[tuple[int, int]]) -> list[int]:
        """The CRC-32 of each ``(start, size)`` range of ``f``, in pieces on the scan threads (kept for its
        blocks when ``cut_at_blocks`` planned them)."""
        return self.crc_pieces.ranges(f, ranges)

    def cut_at_blocks(self, f: Location) -> None:
        """``f`` has a ``.crc32.json`` sidecar checked after its records (a torch zip file zckpt wrote): its
        records' CRCs are kept in pieces and its blocks' combined from them (``zckpt.storage.crc_pieces``)."""
        for suffix, got in block_sidecars(f):
            if suffix == CRC_SIDECAR and not isinstance(got, Problem) and got[0].algorithm == "crc32":
                self.crc_pieces.cut_at(f, got[0].block)

    def _crc_segments(self, f: Location, ranges: list[tuple[int, int]], edge: int) -> list[list[Segment]]:
        if self.scanner is not None:
            return self.scanner.crc_segments(f, ranges, edge)
        with Scanner(1) as s:
            return s.crc_segments(f, ranges, edge)

    def _crc_ranges(self, f: Location, ranges: list[tuple[int, int]]) -> list[int]:
        if self.scanner is not None:
            return self.scanner.crc_ranges(f, ranges)
        with Scanner(1) as s:
            return s.crc_ranges(f, ranges)


def compare_sha(f: Location, want: str, where: str, ctx: VerifyContext) -> list[Problem]:
    """The file's sha256 against the digest ``want`` recorded in ``where``."""
    if str(f) in ctx.broken:
        return []
    ctx.count(1)
    got = ctx.sha256(f)
    if got != want.lower():
        return [
            Problem(
                str(f),
                f"sha256 {got[:16]}... does not match {want[:16]}... recorded in {where}",
                "checksum",
                "the file changed after it was written (bit rot, partial copy, or edited)",
            )
        ]
    return []


def compare_digest(f: Location, want: FileDigest, size: int, where: str, ctx: VerifyContext) -> list[Problem]:
    """The file against a digest ``want`` recorded in ``where``: a whole-file sha256 (``compare_sha``), or
    each block's, computed on several threads; every damaged block is named by its byte range."""
    if want.sha256 is not None:
        return compare_sha(f, want.sha256, where, ctx)
    if str(f) in ctx.broken:
        return []
    ctx.count(len(want.blocks))
    try:
        kept = ctx.crc_pieces.blocks(f, want.block, size) if want.algorithm == "crc32" else None
        got = kept if kept is not None else block_digests(f, want.block, size, want.algorithm)
    except EOFError:
        return [Problem(str(f), f"shorter than the {size} bytes {where} records", "truncated")]
    bad = [i for i, (g, w) in enumerate(zip(got, want.blocks, strict=True)) if g != w]
    if not bad:
        return []
    lo, hi = bad[0] * want.block, min(size, (bad[0] + 1) * want.block)
    more = f" and {len(bad) - 1} more of its {len(got)} blocks" if len(bad) > 1 else ""
    return [
        Problem(
            str(f),
            f"{want.algorithm} of bytes [{lo}, {hi}) (block {bad[0]}){more} does not match the one recorded "
            f"in {where}",
            "checksum",
            "the file changed after it was written (bit rot, partial copy, or edited)",
        )
    ]


def _not_regular(side: Location) -> Problem | None:
    """A ``Problem`` when a sidecar's name exists but is no regular file: a device, pipe, socket, folder or
    link to nothing stands where the checksums should be (never read as "no sidecar")."""
    if side.is_file() or not lexists(side):
        return None
    what = "a link to nothing" if side.is_symlink() and not side.exists() else "not a regular file"
    return Problem(str(side), f"checksum sidecar is {what}", "corrupt", "restore the sidecar, or delete it")


def sidecar_digest(f: Location) -> str | Problem | None:
    """The sha256 that ``<f>.sha256`` records for ``f``; None when there is no sidecar; a ``Problem``
    naming the sidecar when it is not one ``<hex digest>  <name>`` line for ``f``."""
    side = f.with_name(f.name + SIDECAR)
    if not side.is_file():
        return _not_regular(side)
    try:
        with fileio.open_regular(side) as fh:
            fields = fh.read(4096).decode().split()
    except (OSError, UnicodeDecodeError, CorruptCheckpoint) as e:
        return Problem(str(side), f"unreadable checksum sidecar ({e})", "corrupt")
    if not fields or not re.fullmatch(r"[0-9a-fA-F]{64}", fields[0]):
        return Problem(str(side), "checksum sidecar does not start with a sha256 hex digest", "corrupt")
    if len(fields) > 1 and fields[1].lstrip("*") != f.name:
        return Problem(str(side), f"checksum sidecar names {fields[1]!r:.80}, not {f.name!r}", "inconsistent")
    return fields[0].lower()


_HEX = {"crc32": re.compile(r"[0-9a-f]{8}"), "sha256": re.compile(r"[0-9a-f]{64}")}


def block_sidecar_digest(f: Location, suffix: str = CRC_SIDECAR) -> tuple[FileDigest, int] | Problem | None:
    """The block digests and size that ``<f><suffix>`` records for ``f``: ``.crc32.json`` (what
    ``zckpt.storage.digest.write_block_sidecar`` writes: format ``zckpt-block-crc32``, version 1) or the
    earlier ``.sha256.json``; None when there is none; a ``Problem`` naming the sidecar when it is not one
    for ``f`` (or a later version of the format)."""
    side = f.with_name(f.name + suffix)
    if not side.is_file():
        return _not_regular(side)
    try:
        doc = json.loads(fileio.read_capped(side, 64 << 20, "a block-digest sidecar", "restore or delete it"))
    except (OSError, UnicodeDecodeError, ValueError, CorruptCheckpoint) as e:
        return Problem(str(side), f"unreadable checksum sidecar ({str(e)[:100]})", "corrupt")
    algorithm = "crc32" if suffix == CRC_SIDECAR else "sha256"
    if algorithm == "crc32" and isinstance(doc, dict):
        if doc.get("format") != CRC_SIDECAR_FORMAT:
            return Problem(str(side), f'not a {CRC_SIDECAR_FORMAT} sidecar (its "format")', "corrupt")
        version = doc.get("version")
        if version != CRC_SIDECAR_VERSION:
            return Problem(
                str(side),
                f"block-checksum sidecar version {version!r:.20}; this zckpt reads version "
                f"{CRC_SIDECAR_VERSION}",
                "unsupported",
                "a newer zckpt wrote it: upgrade zckpt to check the file",
            )
    size, block = (doc.get("size"), doc.get("block")) if isinstance(doc, dict) else (None, None)
    digests = doc.get(algorithm) if isinstance(doc, dict) else None
    hexdigest = _HEX[algorithm]
    ok = (
        type(size) is int and size >= 0 and type(block) is int and block > 0 and isinstance(digests, list)
        and len(digests) == -(-size // block)
        and all(isinstance(d, str) and hexdigest.fullmatch(d) for d in digests)
    )  # fmt: skip
    if not ok:
        return Problem(
            str(side), f"not a block-digest sidecar (size, block and one {algorithm} per block)", "corrupt"
        )
    if doc.get("file") != f.name:
        return Problem(
            str(side), f"checksum sidecar names {doc.get('file')!r:.80}, not {f.name!r}", "inconsistent"
        )
    assert isinstance(block, int) and isinstance(size, int) and isinstance(digests, list)
    return FileDigest(block=block, blocks=tuple(digests), algorithm=algorithm), size


def block_sidecars(f: Location) -> list[tuple[str, tuple[FileDigest, int] | Problem]]:
    """``f``'s block sidecars that exist (or stand there broken): ``(suffix, digest and size, or a Problem)``,
    the ``.crc32.json`` first."""
    out: list[tuple[str, tuple[FileDigest, int] | Problem]] = []
    for suffix in (CRC_SIDECAR, BLOCK_SIDECAR):
        got = block_sidecar_digest(f, suffix)
        if got is not None:
            out.append((suffix, got))
    return out


def file_check(path: Location, size: int | None = None) -> Checked | None:
    """What a reader verifies ``path``'s bytes against (``Piece.check``) when it has a sidecar: the whole-file
    sha256 of ``<path>.sha256``, or the block digests of ``<path>.crc32.json`` (else of an older
    ``<path>.sha256.json``); None without one. A broken sidecar, or a block sidecar that records another size
    than the file's (``size``, else read), is refused (``block_sidecar_of``)."""
    digest = sidecar_digest(path)
    if isinstance(digest, Problem):
        raise CorruptCheckpoint(
            str(digest), hint="fix or delete the sidecar (`zckpt verify` checks the file)", path=digest.file
        )
    have = size_of(path) if size is None else size
    if digest is not None:
        return Checked(str(path), 0, have, None, "checksum sidecar", sha256=digest)
    found = block_sidecar_of(path, have)
    if found is None:
        return None
    suffix, d = found
    what = f"sidecar {suffix}"  # the file is named beside it
    return Checked(str(path), 0, have, None, what, block=d.block, blocks=d.blocks, algorithm=d.algorithm)


def block_sidecar_of(path: Location, size: int) -> tuple[str, FileDigest] | None:
    """``path``'s block sidecar (its suffix and digests: the ``.crc32.json``, else an older ``.sha256.json``),
    None without one. A broken one is refused, and so is one that records another size than ``size``, the
    file's: it was cut, grown or replaced after zckpt wrote it."""
    found = block_sidecars(path)
    if not found:
        return None
    suffix, blocks = found[0]
    if isinstance(blocks, Problem):
        raise CorruptCheckpoint(
            str(blocks), hint="fix or delete the sidecar (`zckpt verify` checks the file)", path=blocks.file
        )
    d, want = blocks
    if want != size:
        raise CorruptCheckpoint(
            f"{path}: {size} bytes, but its sidecar {path.name + suffix} records {want}",
            hint="restore the file from a good copy; if it was replaced on purpose, delete the stale sidecar",
            path=str(path),
        )
    return suffix, d


def check_sidecar(f: Location, ctx: VerifyContext) -> list[Problem]:
    """``f`` against its sidecars, when it has them: ``<f>.sha256`` (``sha256sum``), ``<f>.crc32.json`` and
    ``<f>.sha256.json`` (block digests, checked on several cores)."""
    out: list[Problem] = []
    want = sidecar_digest(f)
    if isinstance(want, Problem):
        out.append(want)
    elif want is not None:
        out += compare_sha(f, want, f.name + SIDECAR, ctx)
    for suffix, blocks in block_sidecars(f):
        if isinstance(blocks, Problem):
            out.append(blocks)
            continue
        digest, size = blocks
        have = size_of(f)
        if have != size:
            kind = "truncated" if have < size else "corrupt"
            msg = f"{have} bytes, but {f.name + suffix} records {size}"
            hint = "the file changed after it was written (partial copy, or edited)"
            out.append(Problem(str(f), msg, kind, hint))
        else:
            out += compare_digest(f, digest, size, f.name + suffix, ctx)
    return out


def orphan_sidecars(p: Location, files: list[Location]) -> list[Problem]:
    """Sidecars whose file is gone."""
    known = {resolved(f) for f in files}
    folders = {f.parent for f in files} | ({p} if p.is_dir() else set())
    out = []
    for d in ordered(folders):
        for side in ordered(side for suffix in SIDECARS for side in d.glob(f"*{suffix}")):
            target = side.with_name(side.name[: -len(sidecar_suffix(side.name))])
            if not target.exists() and resolved(target) not in known:
                out.append(
                    Problem(str(target), f"missing (its checksum sidecar {side.name} exists)", "missing")
                )
    return out


def kind_of(e: ZckptError) -> str:
    """The ``Problem.kind`` of a reader's error (from its message, not the path it names)."""
    msg = str(e)
    if e.path and msg.startswith(f"{e.path}: "):
        msg = msg[len(e.path) + 2 :]
    if isinstance(e, UnsafePickle):
        return "unsafe"
    if isinstance(e, Unsupported):
        return "unsupported"
    if "truncated" in msg or "past the end" in msg or "too short" in msg:
        return "truncated"
    if isinstance(e, ShardMismatch):
        if "missing" in msg:
            return "missing"
        if "stale" in msg or "extra" in msg or "second file" in msg:
            return "stale"
        return "inconsistent"
    if isinstance(e, (CorruptCheckpoint, KeyMappingError, UnknownFormat)):
        return "missing" if "missing" in msg or "no such" in msg else "corrupt"
    return "corrupt"


def problem_from(e: ZckptError, default: Location) -> Problem:
    """A reader's error as a ``Problem`` naming the file it is about."""
    msg = str(e)
    file = e.path or str(default)
    if msg.startswith(f"{file}: "):
        msg = msg[len(file) + 2 :]
    elif e.path is None and ": " in msg and fileio.exists(msg.split(": ", 1)[0]):
        file, msg = msg.split(": ", 1)
    return Problem(file, msg, kind_of(e), e.hint)
