"""``zckpt verify``: everything about a checkpoint's integrity that can be checked without a trainer.

Checks, in order (each failure becomes one ``Problem`` naming its file; checking goes on):

1. The format reader opens it. Readers already validate structure: every rank file present, no
   extra or stale rank files, world size / tag / partition counts consistent, every tensor fully
   covered by its pieces, index and shards agreeing. Their typed error becomes a problem.
2. Every file: present, non-empty, readable. safetensors: header strictly parsed and, as the spec
   requires, the data section exactly covered — no holes and no trailing bytes
   (``zckpt.codecs.safetensors.check_file``). torch zip (``.pt/.bin/.pth/.ckpt``): every record's CRC-32
   recomputed and the pickle parsed through the safe unpickler, every storage record present and long
   enough (``zckpt.codecs.torchzip_verify.check_file``).
3. Every piece's bytes lie inside its file.
4. Checksums, wherever recorded: ``<file>.crc32.json`` block sidecars (written through
   ``zckpt.storage.sink.HashingSink``), the ``<file>.sha256.json`` of earlier versions and ``<file>.sha256``
   (``sha256sum`` format). A sidecar whose file is gone is a problem too. With ``sha256=True`` each file's
   whole sha256 is computed as well and reported (to compare with a digest published elsewhere).
5. The format's own checks (``Format.verify``): e.g. the native manifest's digests and sizes, HF shards
   on disk that the index does not list, DeepSpeed files written by different DeepSpeed versions.

The report is ``ok`` only when there are no problems; its text is one line per damaged file (the first
problem and a count of the others) and a summary, ``--json`` lists every problem. When the reader fails,
the file-level checks still run over the files found on disk, so one run lists every damaged file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zckpt import formats
from zckpt.checkpoint import Checkpoint
from zckpt.codecs import safetensors, torchzip, torchzip_verify
from zckpt.errors import PathNotFound, UnknownFormat, Unsupported, ZckptError
from zckpt.formats.base import Format
from zckpt.ops.paths import input_kind
from zckpt.ops.progress import bar as progress_bar
from zckpt.ops.scope import storage_scoped
from zckpt.storage import fileio, scan, session
from zckpt.storage.location import Location, location, ordered
from zckpt.storage.objstore import RemotePath
from zckpt.storage.scan import Scanner
from zckpt.storage.session import Storage
from zckpt.storage.threads import Pool
from zckpt.stream.integrity import Problem, VerifyContext, check_sidecar, orphan_sidecars, problem_from

SCHEMA_VERSION = 1
TENSOR_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
__all__ = ["Problem", "VerifyReport", "verify"]


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` checked and found."""

    path: str
    format: str | None
    tag: str | None
    world_size: int | None
    tensors: int | None
    files: tuple[str, ...]
    checksums: int
    """Checksums recomputed and compared (sidecars and manifest entries)."""
    problems: tuple[Problem, ...]
    sha256: tuple[tuple[str, str], ...] = ()
    """``(file, whole-file sha256)`` of each file, when asked for (``verify(sha256=True)``)."""

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def summary(self) -> str:
        """One line: the verdict, what was checked and how much."""
        what = input_kind(self.format, self.path)
        if self.tag:
            what += f" (tag {self.tag})"
        if self.world_size is not None:
            what += f", world size {self.world_size}"
        nf, nc = len(self.files), self.checksums
        counts = f"{nf} file{'s' * (nf != 1)}, {nc} checksum{'s' * (nc != 1)} verified"
        if self.tensors is not None:
            counts = f"{self.tensors} tensor{'s' * (self.tensors != 1)}, " + counts
        n, nf = len(self.problems), len({p.file for p in self.problems})
        verdict = "OK" if self.ok else f"{n} problem{'s' * (n != 1)} in {nf} file{'s' * (nf != 1)}"
        return f"{self.path}: {what}: {counts}: {verdict}"

    def to_text(self) -> str:
        """One line per file with problems (its first problem, and how many more), then the summary;
        ``to_json`` lists every problem."""
        by_file: dict[str, list[Problem]] = {}
        for p in self.problems:
            by_file.setdefault(p.file, []).append(p)
        lines = []
        for ps in by_file.values():
            line, more = str(ps[0]), len(ps) - 1
            if more:
                kinds = ", ".join(sorted({q.kind for q in ps}))
                s = "s" * (more != 1)
                line += f" (and {more} more problem{s} in this file: {kinds}; --json lists all)"
            lines.append(line + (f" (hint: {ps[0].hint})" if ps[0].hint else ""))
        sums = [f"{digest}  {file}" for file, digest in self.sha256]  # ``sha256sum -c`` reads these lines
        return "\n".join([*sums, *lines, self.summary()])

    def to_json(self) -> dict[str, Any]:
        """This report as JSON values (what ``zckpt verify --json`` prints)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "ok": self.ok,
            "path": self.path,
            "format": self.format,
            "tag": self.tag,
            "world_size": self.world_size,
            "tensors": self.tensors,
            "files": list(self.files),
            "checksums": self.checksums,
            "problems": [p.to_json() for p in self.problems],
        } | ({"sha256": dict(self.sha256)} if self.sha256 else {})


@storage_scoped
def verify(
    path: str | Path,
    *,
    tag: str | None = None,
    trust_pickle: bool = False,
    storage_options: Mapping[str, str] | None = None,
    sha256: bool = False,
    progress: bool = True,
    storage: Storage | None = None,
) -> VerifyReport:
    """Check a checkpoint's integrity (see the module docstring). Raises ``UnknownFormat`` only when
    ``path`` does not exist or is not a checkpoint at all (no format recognises it and it holds no tensor
    file to check: a text file, an empty folder), as ``inspect`` does; every other failure, an
    unrecognisable but damaged checkpoint included, is reported as a ``Problem``. ``storage_options``:
    the object-store client's options for ``s3://`` paths. ``sha256``: also compute each file's whole
    sha256 (``VerifyReport.sha256``; what ``sha256sum`` prints). ``progress``: a bar of the bytes of the
    files checked so far, on stderr when it is a terminal."""
    p = location(path)
    if not p.exists():
        raise PathNotFound(f"{p}: no such file or folder", path=str(p))
    st = session.current()
    st.cache(torchzip.PARSES)  # the reader's parse of each torch archive is the file check's too
    try:
        return _read_and_verify(p, tag, trust_pickle, sha256, progress)
    finally:
        st.forget(torchzip.PARSES)


def _read_and_verify(
    p: Location, tag: str | None, trust_pickle: bool, sha256: bool, progress: bool
) -> VerifyReport:
    problems: list[Problem] = []
    try:
        fmt: Format | None = formats.detect(p)
    except Unsupported:  # a format zckpt knows and does not read (Megatron's legacy one): as ``inspect``
        raise
    except UnknownFormat as e:
        if _nothing_to_check(p):  # not a checkpoint at all: the error ``inspect`` gives (exit 2)
            raise
        fmt = None
        problems.append(problem_from(e, p))
    except ZckptError as e:
        fmt = None
        problems.append(problem_from(e, p))
    ckpt: Checkpoint | None = None
    if fmt is not None:
        try:
            ckpt = fmt.read(p, tag=tag, trust_pickle=trust_pickle)
        except ZckptError as e:
            problems.append(problem_from(e, p))
    try:
        with Scanner() as scanner:
            ctx = VerifyContext(trust=trust_pickle, tag=tag, scanner=scanner)
            report = _verify(p, fmt, ckpt, problems, ctx, progress)
            if not sha256:
                return report
            files = [f for f in map(location, report.files) if _is_file(f)]
            sums = [(str(f), scanner.sha256(str(f))) for f in files]  # side by side on the scan threads
            return replace(report, sha256=tuple((f, s.result()) for f, s in sums))
    finally:
        if ckpt is not None:
            ckpt.close()


def _verify(
    p: Location,
    fmt: Format | None,
    ckpt: Checkpoint | None,
    problems: list[Problem],
    ctx: VerifyContext,
    progress: bool = False,
) -> VerifyReport:
    name = fmt.name if fmt is not None else None
    files = [location(f) for f in ckpt.meta.files] if ckpt is not None else _files_on_disk(p)
    file_problems: list[Problem] = []
    k = max(1, min(len(files), scan.threads()))
    sizes = [_size(f) for f in files]
    with (
        Pool(k, thread_name_prefix="zckpt-verify") as pool,
        scan.shared(k),
        progress_bar(sum(sizes), "verify", enabled=progress) as bar,
    ):
        for found, size in zip(pool.map(lambda f: _check_file(f, ctx), files), sizes, strict=True):
            file_problems += found  # side by side, reported in order
            bar.update(size)
    if ckpt is not None:
        file_problems += _check_pieces(ckpt)
    file_problems += orphan_sidecars(p, files)
    if fmt is not None:
        file_problems += fmt.verify(p, ckpt, ctx)
    # One path form (the one the user gave: readers may name files by their absolute path), then a reader
    # error about a file that the file checks describe better is not repeated.
    problems = [_as_given(q, p) for q in problems]
    file_problems = [_as_given(q, p) for q in file_problems]
    named = {q.file for q in file_problems}
    names = {Path(n).name for n in named}
    problems = [q for q in problems if q.file not in named and not any(n in q.message for n in names)]
    problems += file_problems
    m = ckpt.meta if ckpt is not None else None
    return VerifyReport(
        path=str(p),
        format=name,
        tag=m.tag if m else None,
        world_size=m.world_size if m else None,
        tensors=len(ckpt.entries) if ckpt is not None else None,
        files=tuple(str(f) for f in files),
        checksums=ctx.checksums,
        problems=tuple(_dedupe(problems)),
    )


def _as_given(q: Problem, root: Location) -> Problem:
    """``q`` naming its file the way the user named the checkpoint (``ckpt/x.pt``, not ``/abs/ckpt/x.pt``,
    or the other way round), so one file is one key and one spelling in the report."""
    if "://" in q.file or isinstance(root, RemotePath):
        return q
    f = Path(q.file)
    if f.is_absolute() == root.is_absolute():
        return q
    try:
        rel = f.resolve().relative_to(root.resolve())
    except (ValueError, OSError):
        return q
    return replace(q, file=str(root / rel) if rel.parts else str(root))


def _dedupe(problems: list[Problem]) -> list[Problem]:
    """Drop repeats: the same message twice, or a second checksum mismatch of one file (its sidecar
    and a manifest both record it)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for q in problems:
        key = (q.file, "checksum" if q.kind == "checksum" else q.message)
        if key not in seen:
            seen.add(key)
            out.append(q)
    return out


def _nothing_to_check(p: Location) -> bool:
    """No format recognises ``p`` and it holds no tensor file: a text file, an empty or unrelated folder."""
    return p.suffix not in TENSOR_SUFFIXES if p.is_file() else not _files_on_disk(p)


def _files_on_disk(p: Location) -> list[Location]:
    """Tensor files to check when no reader could open the checkpoint: the file, or tensor files up
    to two folders deep (a DeepSpeed save dir holds its tag folders)."""
    if p.is_file():
        return [p]
    out = [f for pattern in ("*", "*/*") for f in ordered(p.glob(pattern))]
    return [f for f in out if f.suffix in TENSOR_SUFFIXES and _is_file(f)]


def _size(f: Location) -> int:
    """``f``'s size for the progress bar (0 where it cannot be had: the checks say why)."""
    try:
        return fileio.size(str(f))
    except (OSError, ZckptError):
        return 0


def _is_file(f: Location) -> bool:
    """``f.is_file()``, False where a folder on the way may not be entered (the reader named it)."""
    try:
        return f.is_file()
    except OSError:
        return False


def _check_file(f: Location, ctx: VerifyContext) -> list[Problem]:
    if not f.exists():
        return [Problem(str(f), "missing", "missing", "restore the file from the original save")]
    try:
        with fileio.open_regular(f) as fh:
            size = fileio.file_size(fh)
    except ZckptError as e:
        return [problem_from(e, f)]
    if size == 0:
        return [Problem(str(f), "empty file (0 bytes)", "truncated", "the save or copy did not finish")]
    out: list[Problem] = []
    if f.suffix == ".safetensors":
        out += safetensors.check_file(f)
    elif f.suffix in TENSOR_SUFFIXES:
        ctx.cut_at_blocks(f)  # one read of its records' bytes serves its .crc32.json blocks too
        out += torchzip_verify.check_file(f, ctx)
    if out:
        ctx.broken.add(str(f))
        return out
    return check_sidecar(f, ctx)


def _check_pieces(ckpt: Checkpoint) -> list[Problem]:
    sizes: dict[str, int] = {}
    out = []
    for e in ckpt.entries.values():
        for pc in e.pieces:
            if not pc.file:
                continue
            if pc.file not in sizes:
                try:
                    sizes[pc.file] = fileio.size(pc.file)
                except OSError:
                    sizes[pc.file] = -1
            size = sizes[pc.file]
            end = pc.byte_offset + pc.nbytes
            if size >= 0 and (pc.byte_offset < 0 or end > size):
                out.append(
                    Problem(
                        pc.file,
                        f"{e.key}: needs bytes [{pc.byte_offset}, {end}) but the file has {size} "
                        "(truncated?)",
                        "truncated",
                    )
                )
                break
    return out
