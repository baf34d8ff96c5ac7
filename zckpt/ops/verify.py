"""``zckpt verify``: everything about a checkpoint's integrity that can be checked without a trainer.

Checks, in order (each failure becomes one ``Problem`` naming its file; checking goes on):

1. The format reader opens it. Readers already validate structure: every rank file present, no
   extra or stale rank files, world size / tag / partition counts consistent, every tensor fully
   covered by its pieces, index and shards agreeing. Their typed error becomes a problem.
2. Every file: present, non-empty, readable. safetensors: header strictly parsed
   (``formats.hf.read_header``) and, as the spec requires, the data section exactly covered — no
   holes and no trailing bytes. torch zip (``.pt/.bin/.pth/.ckpt``): every record's CRC-32
   recomputed (``zipfile.testzip`` reads all bytes) and the pickle parsed through the safe
   unpickler, every storage record present and long enough.
3. Every piece's bytes lie inside its file.
4. Checksums, wherever recorded: ``<file>.sha256`` sidecars (``sha256sum`` format, written by
   ``consolidate``/``reshard`` through ``zckpt.io.outputs.HashingSink``) and, for formats that keep
   one, their manifest (``_FORMAT_CHECKS``). A sidecar whose file is gone is a problem too.
5. Format-specific checks (``_FORMAT_CHECKS`` by format name, plus an optional
   ``verify(path, ckpt) -> list[Problem]`` function in the format module): HF shards on disk that
   the index does not list; DeepSpeed files written by different DeepSpeed versions.

The report is ``ok`` only when there are no problems. When the reader fails, the file-level checks
still run over the files found on disk, so one run lists every damaged file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zckpt import formats
from zckpt.checkpoint import Checkpoint
from zckpt.errors import (
    CorruptCheckpoint,
    KeyMappingError,
    ShardMismatch,
    UnknownFormat,
    UnsafePickle,
    Unsupported,
    ZckptError,
)

SCHEMA_VERSION = 1
TENSOR_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
SIDECAR = ".sha256"
_BUF = 8 << 20

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

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        what = f"{self.format or 'unrecognised'} checkpoint"
        if self.tag:
            what += f" (tag {self.tag})"
        if self.world_size is not None:
            what += f", world size {self.world_size}"
        counts = f"{len(self.files)} files, {self.checksums} checksums verified"
        if self.tensors is not None:
            counts = f"{self.tensors} tensors, " + counts
        verdict = "OK" if self.ok else f"{len(self.problems)} problem{'s' * (len(self.problems) != 1)}"
        return f"{self.path}: {what}: {counts}: {verdict}"

    def to_text(self) -> str:
        lines = [str(p) + (f" (hint: {p.hint})" if p.hint else "") for p in self.problems]
        return "\n".join([*lines, self.summary()])

    def to_json(self) -> dict[str, Any]:
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
        }


def verify(path: str | Path, *, tag: str | None = None, trust_pickle: bool = False) -> VerifyReport:
    """Check a checkpoint's integrity (see the module docstring). Raises only when ``path`` does
    not exist; every other failure is reported as a ``Problem``."""
    p = Path(path)
    if not p.exists():
        raise UnknownFormat(f"{p}: no such file or folder", path=str(p))
    problems: list[Problem] = []
    try:
        mod: types.ModuleType | None = formats.detect(p)
    except ZckptError as e:
        mod = None
        problems.append(_from_error(e, p))
    ckpt: Checkpoint | None = None
    if mod is not None:
        try:
            ckpt = mod.read(p, tag=tag, trust_pickle=trust_pickle)
        except ZckptError as e:
            problems.append(_from_error(e, p))
    try:
        return _verify(p, mod, ckpt, problems, trust_pickle, tag)
    finally:
        if ckpt is not None:
            ckpt.close()


def _verify(
    p: Path,
    mod: types.ModuleType | None,
    ckpt: Checkpoint | None,
    problems: list[Problem],
    trust: bool,
    tag: str | None,
) -> VerifyReport:
    name = getattr(mod, "NAME", None)
    files = [Path(f) for f in ckpt.meta.files] if ckpt is not None else _files_on_disk(p)
    ctx = _Ctx(trust=trust, tag=tag)
    file_problems: list[Problem] = []
    for f in files:
        file_problems += _check_file(f, ctx)
    if ckpt is not None:
        file_problems += _check_pieces(ckpt)
    file_problems += _orphan_sidecars(p, files)
    check = _FORMAT_CHECKS.get(name or "")
    if check is not None:
        file_problems += check(p, ckpt, ctx)
    hook = getattr(mod, "verify", None)
    if callable(hook):
        file_problems += hook(p, ckpt)
    # A reader error about a file that the file checks describe better is not repeated.
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


@dataclass
class _Ctx:
    trust: bool
    tag: str | None = None
    checksums: int = 0
    pickles: dict[str, Any] | None = None
    hashes: dict[str, str] | None = None
    broken: set[str] = field(default_factory=set)
    """Files already reported as structurally broken: their checksums are not compared too."""

    def sha256(self, f: Path) -> str:
        """The file's sha256, computed once however many records (sidecar, manifest) name it."""
        if self.hashes is None:
            self.hashes = {}
        key = str(f)
        if key not in self.hashes:
            self.hashes[key] = sha256_file(f)
        return self.hashes[key]

    def remember(self, f: Path, obj: Any) -> None:
        if self.pickles is None:
            self.pickles = {}
        self.pickles[str(f)] = obj


# ---- errors -> problems ----------------------------------------------------------------------------
def _kind(e: ZckptError) -> str:
    msg = str(e)
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


def _from_error(e: ZckptError, default: Path) -> Problem:
    msg = str(e)
    file = e.path or str(default)
    if msg.startswith(f"{file}: "):
        msg = msg[len(file) + 2 :]
    elif e.path is None and ": " in msg and os.path.exists(msg.split(": ", 1)[0]):
        file, msg = msg.split(": ", 1)
    return Problem(file, msg, _kind(e), e.hint)


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


# ---- file-level checks -----------------------------------------------------------------------------
def _files_on_disk(p: Path) -> list[Path]:
    """Tensor files to check when no reader could open the checkpoint: the file, or tensor files up
    to two folders deep (a DeepSpeed save dir holds its tag folders)."""
    if p.is_file():
        return [p]
    out = [f for pattern in ("*", "*/*") for f in sorted(p.glob(pattern))]
    return [f for f in out if f.is_file() and f.suffix in TENSOR_SUFFIXES]


def _check_file(f: Path, ctx: _Ctx) -> list[Problem]:
    if not f.is_file():
        return [Problem(str(f), "missing", "missing", "restore the file from the original save")]
    try:
        size = f.stat().st_size
        with open(f, "rb"):
            pass
    except OSError as e:
        return [Problem(str(f), f"unreadable ({e.strerror})", "corrupt")]
    if size == 0:
        return [Problem(str(f), "empty file (0 bytes)", "truncated", "the save or copy did not finish")]
    out: list[Problem] = []
    if f.suffix == ".safetensors":
        out += _check_safetensors(f, size)
    elif f.suffix in TENSOR_SUFFIXES:
        out += _check_torch_zip(f, ctx)
    if out:
        ctx.broken.add(str(f))
        return out
    return _check_sidecar(f, ctx)


def _check_safetensors(f: Path, size: int) -> list[Problem]:
    from zckpt.formats.hf import read_header

    try:
        header, _, start = read_header(f)
    except ZckptError as e:
        return [_from_error(e, f)]
    spans = sorted((int(i["data_offsets"][0]), int(i["data_offsets"][1]), n) for n, i in header.items())
    end = 0
    for lo, hi, name in spans:
        if lo > end:
            return [Problem(str(f), f"{lo - end}-byte hole in the data section before {name!r}", "corrupt")]
        end = max(end, hi)
    data = size - start
    if data > end:
        return [
            Problem(
                str(f),
                f"{data - end} trailing bytes after the last tensor (the header covers {end} of {data})",
                "corrupt",
                "the file was appended to or its header rewritten; re-create it",
            )
        ]
    return []


def _check_torch_zip(f: Path, ctx: _Ctx) -> list[Problem]:
    from zckpt.io.torchzip import load_refs

    if not zipfile.is_zipfile(f):
        return [
            Problem(
                str(f),
                "not a readable zip archive (truncated, or a legacy pre-1.6 torch file)",
                "truncated",
                "re-copy the file, or check the save finished",
            )
        ]
    try:
        with zipfile.ZipFile(f) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return [Problem(str(f), f"zip records unreadable ({e})", "truncated")]
    except Exception as e:  # zlib.error and friends: a damaged record, not a bug of ours
        return [Problem(str(f), f"zip records unreadable ({type(e).__name__}: {e})", "corrupt")]
    if bad is not None:
        return [Problem(str(f), f"zip record {bad} fails its CRC-32 check", "corrupt", "the file is damaged")]
    try:
        ctx.remember(f, load_refs(str(f), trust_pickle=ctx.trust))
    except ZckptError as e:
        return [_from_error(e, f)]
    return []


def sha256_file(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        while block := fh.read(_BUF):
            h.update(block)
    return h.hexdigest()


def _check_sidecar(f: Path, ctx: _Ctx) -> list[Problem]:
    side = f.with_name(f.name + SIDECAR)
    if not side.is_file():
        return []
    try:
        fields = side.read_text().split()
    except (OSError, UnicodeDecodeError) as e:
        return [Problem(str(side), f"unreadable checksum sidecar ({e})", "corrupt")]
    if not fields or not re.fullmatch(r"[0-9a-f]{64}", fields[0]):
        return [Problem(str(side), "checksum sidecar does not start with a sha256 hex digest", "corrupt")]
    if len(fields) > 1 and fields[1].lstrip("*") != f.name:
        return [Problem(str(side), f"checksum sidecar names {fields[1]!r}, not {f.name!r}", "inconsistent")]
    return _compare_sha(f, fields[0], side.name, ctx)


def _compare_sha(f: Path, want: str, where: str, ctx: _Ctx) -> list[Problem]:
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


def _orphan_sidecars(p: Path, files: list[Path]) -> list[Problem]:
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


def _check_pieces(ckpt: Checkpoint) -> list[Problem]:
    sizes: dict[str, int] = {}
    out = []
    for e in ckpt.entries.values():
        for pc in e.pieces:
            if not pc.file:
                continue
            if pc.file not in sizes:
                try:
                    sizes[pc.file] = os.path.getsize(pc.file)
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


# ---- per-format checks -----------------------------------------------------------------------------
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})(?P<suffix>\..+)$")


def _hf_checks(p: Path, ckpt: Checkpoint | None, ctx: _Ctx) -> list[Problem]:
    """Shard files on disk that the index does not list (stale from a save with another shard count)."""
    if not p.is_dir():
        return []
    out = []
    indexes = sorted(p.glob("*.index.json"))
    listed: set[str] = set()
    for idx in indexes:
        try:
            wm = json.loads(idx.read_text()).get("weight_map") or {}
        except (OSError, ValueError, AttributeError):
            continue  # the reader reports an unreadable index
        listed |= set(wm.values())
        counts = {m["n"] for f in set(wm.values()) if (m := _SHARD_RE.match(f))}
        if len(counts) > 1:
            out.append(Problem(str(idx), f"index mixes shard counts {sorted(counts)}", "inconsistent"))
        for n in counts:
            want = int(n)
            have = {f for f in set(wm.values()) if _SHARD_RE.match(f)}
            if len(have) != want:
                out.append(
                    Problem(
                        str(idx),
                        f"index lists {len(have)} shard files, their names say {want}",
                        "inconsistent",
                    )
                )
    if indexes:
        for f in sorted(p.iterdir()):
            if f.suffix in TENSOR_SUFFIXES and _SHARD_RE.match(f.name) and f.name not in listed:
                why = "shard file not listed in the index (stale from another save?)"
                out.append(Problem(str(f), why, "stale", "move it away"))
    return out


def _deepspeed_checks(p: Path, ckpt: Checkpoint | None, ctx: _Ctx) -> list[Problem]:
    """Every rank file written by the same DeepSpeed version."""
    versions: dict[str, str] = {}
    for f, obj in (ctx.pickles or {}).items():
        if isinstance(obj, dict):
            v = obj.get("ds_version")
            if v is None and isinstance(obj.get("optimizer_state_dict"), dict):
                v = obj["optimizer_state_dict"].get("ds_version")
            if isinstance(v, str):
                versions[f] = v
    if len(set(versions.values())) <= 1:
        return []
    common = max(set(versions.values()), key=list(versions.values()).count)
    return [
        Problem(f, f"written by DeepSpeed {v}, the other rank files by {common}", "stale", "two runs mixed")
        for f, v in sorted(versions.items())
        if v != common
    ]


def _native_checks(p: Path, ckpt: Checkpoint | None, ctx: _Ctx) -> list[Problem]:
    """The engine's manifest: every listed file present, of the recorded size and sha256; no rank
    file that the manifest does not list; one rank file per rank of the recorded world size."""
    from zckpt.formats import native

    try:
        td = native.resolve(p, ctx.tag)
        man = native.manifest(td)
    except ZckptError:
        return []  # the reader already reported it
    where = str(td / native.MANIFEST)
    files = man.get("files")
    if not isinstance(files, dict):
        return [Problem(where, "manifest has no `files` table of sizes and checksums", "corrupt")]
    out: list[Problem] = []
    for name, rec in sorted(files.items()):
        f = td / name
        if not f.is_file():
            out.append(Problem(str(f), "missing (listed in manifest.json)", "missing"))
            continue
        rec = rec if isinstance(rec, dict) else {}
        if str(f) in ctx.broken:
            continue
        size, want = f.stat().st_size, rec.get("bytes")
        if isinstance(want, int) and size != want:
            kind = "truncated" if size < want else "corrupt"
            out.append(Problem(str(f), f"{size} bytes but manifest.json records {want}", kind))
            continue
        sha = rec.get("sha256")
        if isinstance(sha, str):
            out += _compare_sha(f, sha, native.MANIFEST, ctx)
        else:
            out.append(Problem(str(f), "manifest.json records no sha256 for it", "inconsistent"))
    for f in sorted(td.glob("rank_*.safetensors")):
        if f.name not in files:
            out.append(Problem(str(f), "rank file not listed in manifest.json (stale from another save?)",
                               "stale", "move it away"))  # fmt: skip
    world = man.get("world_size")
    ranks = {n for n in files if re.fullmatch(r"rank_\d+\.safetensors", n)}
    if isinstance(world, int) and len(ranks) != world:
        out.append(Problem(where, f"lists {len(ranks)} rank files for world size {world}", "inconsistent"))
    return out


_FORMAT_CHECKS: dict[str, Callable[[Path, Checkpoint | None, _Ctx], list[Problem]]] = {
    "hf": _hf_checks,
    "deepspeed": _deepspeed_checks,
    "native": _native_checks,
}
