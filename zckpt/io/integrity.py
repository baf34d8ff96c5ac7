"""Integrity findings and checksums: the vocabulary ``verify`` and every format's ``verify`` hook share.

``Problem`` is one thing wrong with one file; ``VerifyContext`` carries what one verify run accumulates
(the checksums compared, each file's sha256 computed once, pickles already parsed, files already found
broken). Checksums: ``<file>.sha256`` sidecars (``sha256sum`` format, written by ``HashingSink``) and
digests recorded by a format's own manifest, compared through ``compare_sha`` (whole file) or
``compare_digest`` (whole file or per block).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
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
from zckpt.io import storage
from zckpt.io.digest import FileDigest, block_digests

SIDECAR = ".sha256"
BUF_BYTES = 8 << 20
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

    def sha256(self, f: Path) -> str:
        """The file's sha256, computed once however many records (sidecar, manifest) name it."""
        key = str(f)
        if key not in self.hashes:
            self.hashes[key] = sha256_file(f)
        return self.hashes[key]


def sha256_file(f: Path) -> str:
    h = hashlib.sha256()
    with storage.open_regular(f) as fh:
        while block := fh.read(BUF_BYTES):
            h.update(block)
    return h.hexdigest()


def compare_sha(f: Path, want: str, where: str, ctx: VerifyContext) -> list[Problem]:
    """The file's sha256 against the digest ``want`` recorded in ``where``."""
    if str(f) in ctx.broken:
        return []
    ctx.checksums += 1
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


def compare_digest(f: Path, want: FileDigest, size: int, where: str, ctx: VerifyContext) -> list[Problem]:
    """The file against a digest ``want`` recorded in ``where``: a whole-file sha256 (``compare_sha``), or
    each block's, computed on several threads; every damaged block is named by its byte range."""
    if want.sha256 is not None:
        return compare_sha(f, want.sha256, where, ctx)
    if str(f) in ctx.broken:
        return []
    ctx.checksums += len(want.blocks)
    try:
        got = block_digests(f, want.block, size)
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
            f"sha256 of bytes [{lo}, {hi}) (block {bad[0]}){more} does not match the one recorded in {where}",
            "checksum",
            "the file changed after it was written (bit rot, partial copy, or edited)",
        )
    ]


def sidecar_digest(f: Path) -> str | Problem | None:
    """The sha256 that ``<f>.sha256`` records for ``f``; None when there is no sidecar; a ``Problem``
    naming the sidecar when it is not one ``<hex digest>  <name>`` line for ``f``."""
    side = f.with_name(f.name + SIDECAR)
    if not side.is_file():
        return None
    try:
        with storage.open_regular(side) as fh:
            fields = fh.read(4096).decode().split()
    except (OSError, UnicodeDecodeError, CorruptCheckpoint) as e:
        return Problem(str(side), f"unreadable checksum sidecar ({e})", "corrupt")
    if not fields or not re.fullmatch(r"[0-9a-fA-F]{64}", fields[0]):
        return Problem(str(side), "checksum sidecar does not start with a sha256 hex digest", "corrupt")
    if len(fields) > 1 and fields[1].lstrip("*") != f.name:
        return Problem(str(side), f"checksum sidecar names {fields[1]!r:.80}, not {f.name!r}", "inconsistent")
    return fields[0].lower()


def check_sidecar(f: Path, ctx: VerifyContext) -> list[Problem]:
    """``f`` against its ``<f>.sha256`` sidecar, when it has one."""
    want = sidecar_digest(f)
    if want is None or isinstance(want, Problem):
        return [want] if want else []
    return compare_sha(f, want, f.name + SIDECAR, ctx)


def orphan_sidecars(p: Path, files: list[Path]) -> list[Problem]:
    """Sidecars whose file is gone."""
    known = {f.resolve() for f in files}
    folders = {f.parent for f in files} | ({p} if p.is_dir() else set())
    out = []
    for d in sorted(folders):
        for side in sorted(d.glob(f"*{SIDECAR}")):
            target = side.with_name(side.name[: -len(SIDECAR)])
            if not target.exists() and target.resolve() not in known:
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


def problem_from(e: ZckptError, default: Path) -> Problem:
    """A reader's error as a ``Problem`` naming the file it is about."""
    msg = str(e)
    file = e.path or str(default)
    if msg.startswith(f"{file}: "):
        msg = msg[len(file) + 2 :]
    elif e.path is None and ": " in msg and storage.exists(msg.split(": ", 1)[0]):
        file, msg = msg.split(": ", 1)
    return Problem(file, msg, kind_of(e), e.hint)
