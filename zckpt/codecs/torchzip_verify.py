"""``verify``'s check of a whole torch zip file (``.pt``/``.bin``/...): every record's CRC-32 recomputed on
the scan threads, each local header matching the central directory, and the pickle parsed through the safe
unpickler (``zckpt.codecs.torchzip``; within ``verify``, the reader's own parse of it)."""

from __future__ import annotations

import zipfile
from typing import BinaryIO

from zckpt.codecs.torchzip import _LOCAL_HEADER, _data_start, is_torch_zip, load_refs
from zckpt.errors import CorruptCheckpoint, ZckptError
from zckpt.storage import fileio
from zckpt.storage.location import Location
from zckpt.stream.integrity import Problem, VerifyContext, problem_from


def _crc_check(f: Location, fh: BinaryIO, zf: zipfile.ZipFile, ctx: VerifyContext) -> tuple[str | None, int]:
    """(the first record whose CRC-32 fails, or None; how many records were checked). Stored records (all
    of torch's) are checked in pieces on the scan threads (``zckpt.storage.scan``); an archive with a
    compressed record goes through ``zipfile``'s own check."""
    infos = zf.infolist()
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        return zf.testzip(), len(infos)
    size = fileio.file_size(fh)
    starts = []
    for info in infos:
        # the name as the directory stores it (zipfile decoded it as UTF-8 or cp437, both reversible)
        raw = info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437")
        fh.seek(info.header_offset)
        head = fh.read(_LOCAL_HEADER.size + len(raw))
        starts.append(_data_start(str(f), info, head[: _LOCAL_HEADER.size], size, str(f)))
        if head[_LOCAL_HEADER.size :] != raw:  # torch's reader never looks: only verify can tell
            raise CorruptCheckpoint(
                f"{f}: zip record {info.filename!r:.80}: its local header names another record",
                hint="the file is damaged; restore it from a good copy",
                path=str(f),
            )
    try:
        crcs = ctx.crc_ranges(f, [(s, i.file_size) for s, i in zip(starts, infos, strict=True)])
    except EOFError as e:
        raise CorruptCheckpoint(f"{f}: {e}", hint="re-copy the file, or check the save finished",
                                path=str(f)) from None  # fmt: skip
    bad = next((i.filename for i, c in zip(infos, crcs, strict=True) if c != i.CRC), None)
    return bad, len(infos)


def check_file(f: Location, ctx: VerifyContext) -> list[Problem]:
    """Every record's CRC-32 recomputed and the pickle parsed through the safe unpickler (remembered in
    ``ctx.pickles`` for cross-file checks), every storage record present and long enough."""
    if not is_torch_zip(str(f)):
        why = "not a readable zip archive (truncated, or a legacy pre-1.6 torch file)"
        return [Problem(str(f), why, "truncated", "re-copy the file, or check the save finished")]
    try:
        with fileio.open_regular(f) as fh, zipfile.ZipFile(fh) as zf:
            bad, records = _crc_check(f, fh, zf, ctx)
    except ZckptError as e:
        return [problem_from(e, f)]
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as e:
        return [Problem(str(f), f"zip records unreadable ({e})", "truncated")]
    except Exception as e:  # zlib.error and friends: a damaged record, not a bug of ours
        return [Problem(str(f), f"zip records unreadable ({type(e).__name__}: {e})", "corrupt")]
    if bad is not None:
        return [Problem(str(f), f"zip record {bad} fails its CRC-32 check", "corrupt", "the file is damaged")]
    ctx.count(records)
    try:
        ctx.pickles[str(f)] = load_refs(str(f), trust_pickle=ctx.trust)
    except ZckptError as e:
        return [problem_from(e, f)]
    return []
