"""Reading ``torch.save`` zip archives without ``torch.load``: structure and byte offsets only.

A torch zip archive holds ``<prefix>/data.pkl`` (the pickled object, tensors as persistent ids) and one
uncompressed record ``<prefix>/data/<key>`` per storage. ``load_refs`` unpickles ``data.pkl`` through
``SafeUnpickler`` and fills every ``TensorRef`` with its file and absolute byte offset, so a reader can
fetch any tensor's bytes (and only those) through ``zckpt.storage.fileio``; ``archive_at`` does the same
for an archive inside a bigger file (through a ``Window`` of it, as DCP writes them)."""

from __future__ import annotations

import copy
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

from zckpt.codecs import zipdir, zipshape
from zckpt.codecs.pickle_safe import Allowed, TensorRef, _Record, safe_loads
from zckpt.errors import CorruptCheckpoint, Unsupported, ZckptError
from zckpt.model import Checked
from zckpt.storage import fileio, session
from zckpt.storage.location import location
from zckpt.stream import integrity
from zckpt.stream.integrity import VerifyContext
from zckpt.stream.window import Window

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


def is_torch_zip(path: str) -> bool:
    try:
        with fileio.open_regular(path) as f:
            return zipfile.is_zipfile(f)
    except zipfile.BadZipFile:  # a zip whose end record it cannot take: the readers say what is wrong
        return True
    except (OSError, ZckptError):
        return False


_ZIP_ERRORS = (
    zipfile.BadZipFile,
    OSError,
    EOFError,
    ValueError,
    OverflowError,
    struct.error,
    NotImplementedError,
    UnicodeDecodeError,
    zlib.error,
    KeyError,
)
"""What ``zipfile`` raises on a damaged archive (a flipped bit, a bad CRC, a short record)."""


_SMALL_RECORD = 1 << 20
"""Records outside ``data/`` up to this size are read (and so CRC-checked) when an archive is opened."""


def _stored(where: str, info: zipfile.ZipInfo | zipdir.Entry, path: str | None = None) -> None:
    """A record torch wrote: stored (uncompressed, not encrypted), so its central directory's two sizes are
    equal (a bigger uncompressed size would still pass a CRC check reading only the stored bytes)."""
    if info.flag_bits & 0x1:
        raise Unsupported(
            f"{where}: record {info.filename!r:.80} is encrypted; torch never writes that", path=path
        )
    if info.compress_type != zipfile.ZIP_STORED:
        raise Unsupported(
            f"{where}: record {info.filename!r:.80} is compressed; torch never writes that", path=path
        )
    if info.compress_size != info.file_size:
        raise CorruptCheckpoint(
            f"{where}: zip record {info.filename!r:.80} is stored but its central directory gives it "
            f"{info.compress_size} bytes stored and {info.file_size} uncompressed",
            hint="the file is damaged: re-copy it, or check the save finished",
            path=path,
        )


def _data_start(where: str, info: zipfile.ZipInfo, head: bytes, length: int, path: str | None = None) -> int:
    """Where a record's bytes start in its archive of ``length`` bytes, from its local header ``head``, which
    must agree with the central directory (torch writes 0s there and a data descriptor after the data)."""
    if len(head) < _LOCAL_HEADER.size or head[:4] != b"PK\x03\x04":
        raise CorruptCheckpoint(f"{where}: broken zip record header for {info.filename!r:.80}", path=path)
    fields = _LOCAL_HEADER.unpack(head)
    crc, size_l = fields[6], fields[8]  # 0 with a data descriptor, 0xFFFFFFFF with zip64 sizes
    if (crc not in (0, info.CRC)) or (size_l not in (0, 0xFFFFFFFF, info.file_size)):
        raise CorruptCheckpoint(
            f"{where}: zip record {info.filename!r:.80}: its local header disagrees with the central "
            "directory (size or CRC-32)",
            hint="re-copy the file, or check the save finished",
            path=path,
        )
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + info.file_size > length:
        raise CorruptCheckpoint(
            f"{where}: record {info.filename!r:.80} runs past the end of its archive", path=path
        )
    return start


def _records(path: str, f: BinaryIO, size: int) -> tuple[str, dict[str, Checked], zipfile.ZipFile]:
    zf = zipfile.ZipFile(f)
    infos = zf.infolist()
    pkl = [i.filename for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if len(pkl) != 1:
        raise CorruptCheckpoint(
            f"{path}: zip archive has {len(pkl)} data.pkl records; not a torch.save file", path=path
        )
    prefix = pkl[0][: -len("data.pkl")]
    out: dict[str, Checked] = {}
    fileio.will_read(f, [(i.header_offset, _LOCAL_HEADER.size) for i in infos])
    for info in infos:
        _stored(path, info, path)
        f.seek(info.header_offset)
        start = _data_start(path, info, f.read(_LOCAL_HEADER.size), size, path)
        out[info.filename] = Checked(path, start, info.file_size, info.CRC, f"zip record {info.filename}")
    return prefix, out, zf


def record_offsets(path: str) -> tuple[str, dict[str, tuple[int, int]]]:
    """(prefix, {record name: (data offset, size)}) of a torch zip archive."""
    with fileio.open_regular(path) as f:
        try:
            prefix, recs, zf = _records(path, f, fileio.file_size(f))
            zf.close()
            out = {name: (c.start, c.size) for name, c in recs.items()}
        except _ZIP_ERRORS as e:
            raise _damaged(path, e) from None
    return prefix, out


_NAMES_DIFFER = re.compile(r"File name in directory (.*) and header (.*) differ", re.DOTALL)


def _reason(e: BaseException) -> str:
    """``zipfile``'s complaint, short enough for one error line: ``BadZipFile`` goes without its name (the
    line says "damaged torch zip archive"), and a local header whose name differs from the directory's quotes
    only the header's (two record names made one line too long)."""
    text = str(e)
    m = _NAMES_DIFFER.match(text)
    if m:
        text = f"local header name {m.group(2)[:60]} differs from the directory"
    if isinstance(e, (zipfile.BadZipFile, zipdir.ZipError)):
        return text[:100]
    return f"{type(e).__name__}: {text[:100]}"


def _damaged(path: str, e: BaseException, file: str | None = None) -> CorruptCheckpoint:
    """``path``: where, in the message (a file, or an archive inside one); ``file``: the file, if not it."""
    return CorruptCheckpoint(
        f"{path}: damaged torch zip archive ({_reason(e)})",
        hint="re-copy the file, or check the save finished",
        path=file or path,
    )


PARSES = "torchzip.parses"
"""The ``Storage.cache`` of archives parsed so far, for an operation that opts in (``verify``: the reader
parses each rank file, and its file checks then take that parse, not a second one). Others do not keep
them: a large world's pickles would stay in memory for the whole operation."""


def load_archive(path: str, *, trust_pickle: bool = False, extra: Allowed | None = None) -> tuple[str, Any]:
    """(archive name: the stem of the file ``torch.save`` wrote, object) of a torch zip archive, tensors as
    ``TensorRef`` (no tensor bytes read); ``extra``: a format's own inert stand-ins (``safe_loads``). Within
    an operation that keeps ``PARSES``, a file is parsed once (the same objects again, never modified)."""
    st = session.bound_storage()
    kept = st.cached(PARSES) if st is not None and extra is None else None
    if kept is not None:
        key = (path if "://" in path else os.path.realpath(path), trust_pickle)
        got: tuple[str, Any] | None = kept.get(key)
        if got is None:
            got = kept[key] = _load_archive(path, trust_pickle, extra)
        return got
    return _load_archive(path, trust_pickle, extra)


def _load_archive(path: str, trust_pickle: bool, extra: Allowed | None) -> tuple[str, Any]:
    with fileio.open_regular(path) as f:
        size = fileio.file_size(f)
        if size == 0:
            raise CorruptCheckpoint(
                f"{path}: empty file (0 bytes)", hint="the save or copy did not finish", path=path
            )
        try:
            is_zip = zipfile.is_zipfile(f)
        except zipfile.BadZipFile as e:  # an end record it cannot take ("span multiple disks")
            raise CorruptCheckpoint(f"{path}: damaged zip end record ({e})", path=path) from None
        if not is_zip:
            raise Unsupported(
                f"{path}: not a zip-format torch file (a legacy torch<1.6 file, or damaged)",
                hint="re-save it with a recent torch.save, or check the copy is complete",
                path=path,
            )
        integrity.block_sidecar_of(location(path), size)  # a sidecar of another size stops here
        prefix, records, data, _ = _pickle_of(path, f, size)
    obj = safe_loads(data, source=path, trust_pickle=trust_pickle, max_bytes=size, extra=extra)
    _place_refs(path, prefix, records, obj)
    return prefix.rstrip("/"), obj


def _pickle_of(path: str, f: BinaryIO, size: int) -> tuple[str, dict[str, Checked], bytes, dict[str, int]]:
    """(prefix, records, data.pkl bytes, each record's CRC-32) of the archive ``f`` of ``size`` bytes."""
    try:
        prefix, records, zf = _records(path, f, size)
        with zf:
            info = zf.getinfo(prefix + "data.pkl")
            if info.file_size > size:
                raise CorruptCheckpoint(f"{path}: data.pkl claims {info.file_size} bytes", path=path)
            for other in zf.infolist():  # the small bookkeeping records (version, byteorder, serialization
                # id...) are CRC-checked here, like data.pkl: no later read covers them
                small = other.file_size <= _SMALL_RECORD and other.filename != info.filename
                if small and not other.filename.startswith(prefix + "data/"):
                    zf.read(other)
            return prefix, records, zf.read(info), {i.filename: i.CRC for i in zf.infolist()}
    except _ZIP_ERRORS as e:
        raise _damaged(path, e) from None


def _place_refs(path: str, prefix: str, records: dict[str, Checked], obj: Any) -> None:
    """Point every ``TensorRef`` of ``obj`` at its storage record, whose CRC-32 reads then verify (not at
    the file's block sidecar, if it has one: a block would be read whole where a job needs part of it, as
    the Adam moments beside an optimizer file's fp32 masters; ``verify`` checks the blocks)."""
    for ref in iter_refs(obj):
        name = f"{prefix}data/{ref.storage.key}"
        if name not in records:
            raise CorruptCheckpoint(f"{path}: tensor storage record {name!r:.80} is missing", path=path)
        rec = records[name]
        _check_view(path, name, ref, rec.size)
        ref.file = path
        ref.byte_offset = rec.start + ref.offset * ref.dtype.itemsize
        ref.check = rec


# ---- archives inside a bigger file (DCP's .distcp files: torch.save archives back to back) -------------
@dataclass(frozen=True)
class EmbeddedArchive:
    """A torch.save archive found at ``offset`` of a file: its object (tensors as ``TensorRef`` with absolute
    byte offsets), and each record's absolute data offset, size and CRC-32."""

    obj: Any
    records: dict[str, tuple[int, int, int]]


def archive_at(
    path: str,
    fd: fileio.Handle,
    offset: int,
    length: int,
    *,
    trust_pickle: bool = False,
    what: str = "",
    memo: dict[tuple[bytes, bool], Any] | None = None,
    win: Window | None = None,
) -> EmbeddedArchive:
    """Parse the torch.save archive at bytes ``[offset, offset + length)`` of ``path`` (open as ``fd``)
    through a window of the file: its central directory, ``data.pkl`` (CRC-32 checked) and the local headers
    of ``data.pkl`` and of the storages it names; no storage byte is read. ``what`` names the item in errors;
    ``memo`` (pickle bytes -> unpickled object) skips unpickling a ``data.pkl`` already seen (DCP's chunk
    archives of same-shaped tensors hold identical pickles); ``win``: a ``Window`` of those bytes already
    read from (its edges are reused)."""
    where = f"{path} [{offset}, +{length}){' ' + what if what else ''}"
    if win is None or (win.fd, win.base, win.length) != (fd, offset, length):
        win = Window(fd, offset, length)
    known = zipshape.known(win.pread, length)  # an archive laid out as one parsed before: no parse
    d = known.directory if known is not None else _directory(where, win, path)
    infos = d.entries
    checked = known.datas if known is not None else {}  # records ``known`` read and checked

    def record(e: zipdir.Entry) -> tuple[int, int, int]:
        if known is not None:
            return known.records[e.filename]  # (the directory's CRC-32s are the learned archive's)
        return _record_at(where, win, e, path)

    pkl = [n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise CorruptCheckpoint(f"{where}: {len(pkl)} data.pkl records; not a torch.save archive", path=path)
    prefix = pkl[0][: -len("data.pkl")]
    for other in infos.values():  # the small bookkeeping records (byteorder, version...) CRC-checked, as for
        # whole files: no later read covers them
        small = other.file_size <= _SMALL_RECORD and other.filename != pkl[0]
        if small and not other.filename.startswith(prefix + "data/") and other.filename not in checked:
            a, n, c = record(other)
            if zlib.crc32(win.pread(n, a)) != c:
                raise _damaged(where, zipdir.ZipError(f"Bad CRC-32 for file {other.filename!r:.80}"), path)
    start, size, crc = record(infos[pkl[0]])
    data = checked.get(pkl[0])
    if data is None:
        data = win.pread(size, start)
        if len(data) != size or zlib.crc32(data) != crc:
            raise CorruptCheckpoint(
                f"{where}: {pkl[0]} fails its CRC-32 check", hint="the file is damaged", path=path
            )
    key = (data, trust_pickle)
    if memo is not None and key in memo:
        obj = _fresh(memo[key])
    else:
        obj = safe_loads(data, source=where, trust_pickle=trust_pickle, max_bytes=length)
        if memo is not None:
            memo[key] = _fresh(obj)
    records = {pkl[0]: (offset + start, size, crc)}
    for ref in iter_refs(obj):
        name = f"{prefix}data/{ref.storage.key}"
        if name not in infos:
            raise CorruptCheckpoint(f"{where}: tensor storage record {name!r:.80} is missing", path=path)
        a, n, c = record(infos[name])
        _check_view(where, name, ref, n)
        ref.file, ref.byte_offset = path, offset + a + ref.offset * ref.dtype.itemsize
        ref.check = Checked(path, offset + a, n, c, f"zip record {name}{' of ' + what if what else ''}")
        records[name] = (offset + a, n, c)
    if known is None:
        zipshape.learn(win.pread, length, d)
    return EmbeddedArchive(obj, records)


def _fresh(obj: Any) -> Any:
    """A copy of an unpickled object that placing its refs will not touch the original of (a lone tensor, as
    DCP's chunks hold, is a shallow copy: its storage, shape and stride are immutable)."""
    return copy.copy(obj) if isinstance(obj, TensorRef) and obj.attrs is None else copy.deepcopy(obj)


def _directory(where: str, win: Window, path: str) -> zipdir.Directory:
    try:
        return zipdir.read(win.pread, win.length)
    except zipdir.ZipError as e:
        raise _damaged(where, e, path) from None


def _record_at(where: str, win: Window, info: zipdir.Entry, path: str | None = None) -> tuple[int, int, int]:
    """(data offset inside the archive, size, CRC-32) of one stored record, from its local header."""
    _stored(where, info, path)
    if not 0 <= info.header_offset <= win.length - zipdir.LOCAL_HEADER.size:
        raise CorruptCheckpoint(
            f"{where}: record {info.filename!r:.80} starts outside its archive", path=path
        )
    head = win.pread(zipdir.LOCAL_HEADER.size + len(info.orig), info.header_offset)
    try:
        start = zipdir.data_start(info, head, win.length)
    except zipdir.ZipError as e:
        raise CorruptCheckpoint(
            f"{where}: {e}", hint="re-copy the file, or check the save finished", path=path
        ) from None
    return start, info.file_size, info.CRC


def check_archive_at(
    path: str, fd: fileio.Handle, offset: int, length: int, ctx: VerifyContext | None = None
) -> str | None:
    """Recompute the CRC-32 of every record of the archive at ``[offset, offset + length)``: the first bad
    record's name, or a description of why the archive cannot be read; None when it is intact. With
    ``ctx``, stored records are checked in pieces on its scan threads (``zckpt.storage.scan``)."""
    return start_archive_check(path, fd, offset, length, ctx)()


def start_archive_check(
    path: str, fd: fileio.Handle, offset: int, length: int, ctx: VerifyContext | None = None
) -> Callable[[], str | None]:
    """``check_archive_at`` in two steps: the archive is parsed and its small records checked now, its big
    records' CRC-32s started on ``ctx``'s scan threads; the call returned waits for them and gives the
    verdict. A caller checking thousands of archives (DCP) starts the next ones meanwhile, so the scan
    threads are all busy even when each archive holds one record; ``fd`` stays open until the call."""
    win = Window(fd, offset, length)
    try:
        known = zipshape.known(win.pread, win.length)  # an archive laid out as one checked before: no parse
        d = known.directory if known is not None else zipdir.read(win.pread, win.length)
        infos = list(d.entries.values())
        if any(i.compress_type != zipfile.ZIP_STORED or i.flag_bits & 0x1 for i in infos):
            return lambda: "zip records unreadable (compressed or encrypted)"
        if known is not None:
            recs = list(known.records.values())
        else:
            recs = [_record_at(path, win, i) for i in infos]
        done = known.datas if known is not None else {}  # records already checked against their CRC-32
        # small records from the window's memory, here; big ones in pieces on the scan threads (a hand-off
        # per small record cost more than its CRC: DCP archives hold ~6 records each, thousands of archives)
        scanner = ctx.scanner if ctx is not None else None
        big = sorted(k for k, (_, n, _) in enumerate(recs) if scanner is not None and n > _SMALL_RECORD)
        crcs = [
            c if i.filename in done else _crc_of(win, start, n) if k not in big else 0
            for k, (i, (start, n, c)) in enumerate(zip(infos, recs, strict=True))
        ]
        pending = None
        if scanner is not None and big:
            pending = scanner.crc_pending(fd, [(offset + recs[k][0], recs[k][1]) for k in big])
    except Exception as e:  # noqa: BLE001 - any zip failure on damaged bytes is a finding, not a crash
        why = _unreadable(e)
        return lambda: why

    def verdict() -> str | None:
        try:
            if pending is not None:
                for k, c in zip(big, pending.result(), strict=True):
                    crcs[k] = c
            bad = next((i.filename for i, r, c in zip(infos, recs, crcs, strict=True) if c != r[2]), None)
            if bad is not None:
                return f"zip record {bad} fails its CRC-32 check"
            if known is not None:  # entries, local headers, descriptors and end records: the shape's, clean
                return None
            for info in infos:
                why = zipdir.entry_problem(win.pread, win.length, info)
                if why is not None:
                    return f"zip record {info.filename}: {why}"
            why = zipdir.end_problem(win.pread, win.length, len(infos), d.start_dir)
            if why is None:
                zipshape.learn(win.pread, win.length, d)
            return why
        except Exception as e:  # noqa: BLE001 - as above
            return _unreadable(e)

    return verdict


def _unreadable(e: Exception) -> str:
    return f"zip records unreadable ({type(e).__name__}: {str(e)[:100]})"


def _crc_of(win: Window, start: int, n: int, step: int = 8 << 20) -> int:
    crc = 0
    for at in range(start, start + n, step):
        crc = zlib.crc32(win.pread(min(step, start + n - at), at), crc)
    return crc


def _check_view(path: str, name: str, ref: TensorRef, nbytes: int) -> None:
    """The tensor's view (offset, shape, stride) must lie inside its storage, and the storage inside its
    record: a view past the end would read another tensor's bytes."""
    if ref.storage.numel < 0 or ref.storage.numel * ref.dtype.itemsize > nbytes:
        raise CorruptCheckpoint(f"{path}: storage record {name!r:.80} is shorter than its tensor", path=path)
    if ref.offset < 0 or any(d < 0 for d in ref.shape) or any(s < 0 for s in ref.stride):
        raise CorruptCheckpoint(
            f"{path}: tensor in {name!r:.80} has a negative offset, size or stride", path=path
        )
    if ref.numel == 0:
        return
    last = ref.offset + sum((d - 1) * s for d, s in zip(ref.shape, ref.stride, strict=False))
    if len(ref.shape) != len(ref.stride) or last >= ref.storage.numel:
        raise CorruptCheckpoint(
            f"{path}: tensor in {name!r:.80} reaches past its storage "
            f"(offset {ref.offset}, shape {list(ref.shape)}, stride {list(ref.stride)}, "
            f"{ref.storage.numel} elements)",
            path=path,
        )


def load_refs(path: str, *, trust_pickle: bool = False) -> Any:
    """Unpickle a torch zip archive's object with tensors as ``TensorRef`` (no tensor bytes read)."""
    return load_archive(path, trust_pickle=trust_pickle)[1]


def iter_refs(obj: Any) -> Any:
    """Every ``TensorRef`` inside a nest of dicts, lists, tuples and stand-in records."""
    stack = [obj]
    seen: set[int] = set()
    while stack:
        o = stack.pop()
        if isinstance(o, TensorRef):
            yield o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            if id(o) not in seen:
                seen.add(id(o))
                stack.extend(o)
        elif isinstance(o, _Record):
            stack.extend(o.__dict__.values())
