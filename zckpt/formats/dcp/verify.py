"""``zckpt verify`` on DCP checkpoints: what the metadata promises, checked against the files.

Works from ``.metadata`` alone, so it reports every damaged file even when the reader could not open the
checkpoint: every item's file present and the item's bytes inside it; the CRC-32 of every record of every
embedded ``torch.save`` archive recomputed (tensor chunks and bytes items: a flipped bit anywhere is found)
and its directory entries, local headers, data descriptors and end records compared field by field;
safetensors blobs parsed; every tensor's boxes tiling it (replicas counted once) with storage for each
chunk; tied aliases (``meta.tied``) holding the same bytes as their owner; no stray files in a DCP folder
(anything but ``.metadata``, the files it names and their ``.sha256`` sidecars); no bytes of a file of
``torch.save`` items outside every item (DCP writes them back to back, from the start to the end).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path

from zckpt.checkpoint import Checkpoint
from zckpt.codecs import safetensors
from zckpt.codecs.torchzip import start_archive_check
from zckpt.errors import ZckptError
from zckpt.formats.dcp import layout
from zckpt.formats.dcp.boxes import distinct, tiling_problem
from zckpt.formats.dcp.chunks import ZIP_MAGIC, ZSTD_MAGIC, Files
from zckpt.formats.dcp.layout import classify
from zckpt.formats.dcp.metadata import METADATA, DcpMetadata, StorageInfo, StorageKey, load_metadata
from zckpt.formats.dcp.read import model_of, pieces
from zckpt.model import Role, TensorEntry
from zckpt.storage import fileio
from zckpt.storage.location import Location, location, ordered
from zckpt.stream.integrity import SIDECARS, Problem, VerifyContext, check_sidecar, problem_from


def _item(key: StorageKey, info: StorageInfo) -> str:
    what = f"chunk {list(key[1])} of {key[0]!r:.80}" if key[1] is not None else f"value {key[0]!r:.80}"
    return f"{what} at bytes [{info.offset}, {info.offset + info.length})"


def _items(md: DcpMetadata, ctx: VerifyContext) -> list[Problem]:
    """Every storage item: file present, bytes inside it, archive CRCs (or blob header) intact."""
    out: list[Problem] = []
    per_file: dict[str, list[Problem]] = {}
    sizes: dict[str, int] = {}
    blobs: set[tuple[str, int]] = set()
    todo: list[tuple[str, StorageKey, StorageInfo]] = []
    with Files(md.folder) as files:
        for key, info in sorted(md.storage.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
            try:
                f = str(files.path(info))
            except ZckptError as e:
                out.append(problem_from(e, location(md.source)))
                continue
            if f not in sizes:
                sizes[f] = fileio.size(f) if fileio.is_file(f) else -1
                if sizes[f] < 0:
                    out.append(Problem(f, "missing (the metadata stores items in it)", "missing",
                                       "restore the file from the original save"))  # fmt: skip
            if sizes[f] < 0:
                continue
            bad = per_file.setdefault(f, [])
            if info.offset + info.length > sizes[f]:
                bad.append(Problem(f, f"{_item(key, info)} ends past the end of the file ({sizes[f]} bytes)",
                                   "truncated", "re-copy the file, or check the save finished"))  # fmt: skip
                continue
            files.open(info)  # opened here, once: the checks below share the descriptors across threads
            todo.append((f, key, info))
        # every item's archive parsed in order, here (a thread per item made thousands of small archives'
        # parsing fight over the GIL: 3x slower), its big records' CRCs computed on the scan threads while the
        # next archives are parsed: up to ``_AHEAD`` per scan thread started and not yet judged
        whys: list[str | None] = []
        ahead: deque[Callable[[], str | None]] = deque()
        limit = _AHEAD * (ctx.scanner.width if ctx.scanner is not None else 1)
        try:
            for _, _, info in todo:
                ahead.append(_start_item(files, info, blobs, ctx))
                if len(ahead) > limit:
                    whys.append(ahead.popleft()())
            while ahead:
                whys.append(ahead.popleft()())
        finally:  # the CRC pieces still running read descriptors that ``files`` closes
            for pending in ahead:
                pending()
        for (f, key, info), why in zip(todo, whys, strict=True):
            if why is not None:
                per_file[f].append(Problem(f, f"{_item(key, info)}: {why}", "corrupt", "the file is damaged"))
    for f, bad in per_file.items():
        if not bad and f not in {b for b, _ in blobs}:
            why = _uncovered([(i.offset, i.length) for g, _, i in todo if g == f], sizes[f])
            if why is not None:
                bad.append(Problem(f, why, "inconsistent", "re-copy the file from the original save"))
    for f, bad in per_file.items():
        if bad:
            ctx.broken.add(f)
        out += bad  # every damaged item: the text report shows one line per file, --json all of them
    return out


def _uncovered(spans_: list[tuple[int, int]], size: int) -> str | None:
    """Bytes of a file of ``torch.save`` items that no item of ``.metadata`` covers. DCP's file writer
    writes a file's items back to back from byte 0 to its end; safetensors-format files (their header,
    alignment) are not checked."""
    pos = 0
    for off, n in sorted(spans_):
        if off > pos:
            return f"bytes [{pos}, {off}) belong to no item of the metadata (a gap between items)"
        pos = max(pos, off + n)
    if pos < size:
        return (f"{size - pos} bytes after its last item (at {pos}) belong to no item of the metadata "
                "(grown or appended to after the save?)")  # fmt: skip
    return None


_AHEAD = 4
"""Archives started per scan thread before the oldest one's verdict is awaited."""


def _start_item(
    files: Files, info: StorageInfo, blobs: set[tuple[str, int]], ctx: VerifyContext
) -> Callable[[], str | None]:
    """The item's check started (``start_archive_check``); the call returned gives its verdict."""
    f, fd = files.open(info)
    head = fileio.pread(fd, 4, info.offset)
    if info.transforms or head == ZSTD_MAGIC:
        return _none  # compressed items: the reader reports them as unsupported
    if head == ZIP_MAGIC:
        ctx.count(1)
        return start_archive_check(f, fd, info.offset, info.length, ctx)
    if (f, info.offset) not in blobs:
        blobs.add((f, info.offset))
        try:
            safetensors.read_header(f, info.offset)
        except ZckptError as e:
            why = (
                f"neither a torch.save archive nor a safetensors blob ({str(e).removeprefix(f + ': ')[:80]})"
            )
            return lambda: why
    return _none


def _none() -> None:
    return None


def _tiling(md: DcpMetadata) -> list[Problem]:
    out = []
    for key, t in md.tensors.items():
        why = tiling_problem(t.shape, t.chunks)
        if why is None:
            gone = [b for b in distinct(t.chunks) if (key, b.offsets) not in md.storage]
            why = f"no storage recorded for chunk {list(gone[0].offsets)}" if gone else None
        if why is not None:
            out.append(Problem(md.source, f"tensor {key!r:.100}: {why}", "inconsistent"))
    return out


def _strays(md: DcpMetadata) -> list[Problem]:
    named = {Path(i.file).name for i in md.storage.values()} | {METADATA}
    named |= {n + side for n in named for side in SIDECARS}
    out = []
    for f in ordered(md.folder.iterdir()):
        if f.is_file() and f.name not in named:
            why = "not named by .metadata (a leftover of another save, or a file copied in)"
            out.append(Problem(str(f), why, "stale", "move it away"))
    return out


def _same_crcs(a: TensorEntry, b: TensorEntry) -> bool | None:
    """Whether ``a`` and ``b`` hold the same bytes, told by their chunks' recorded CRC-32s (torch archives
    record one per storage) when both are cut alike and every record is exactly its chunk; None otherwise."""
    pa, pb = sorted(a.pieces, key=lambda p: p.start), sorted(b.pieces, key=lambda p: p.start)
    if len(pa) != len(pb):
        return None
    for x, y in zip(pa, pb, strict=True):
        if (x.start, x.numel, x.grid, x.dtype) != (y.start, y.numel, y.grid, y.dtype):
            return None
        for c, p in ((x.check, x), (y.check, y)):
            if c is None or c.crc32 is None or c.size != p.nbytes:
                return None
    return all(x.check.crc32 == y.check.crc32 for x, y in zip(pa, pb, strict=True))  # type: ignore[union-attr]


def _same_bytes(a: TensorEntry, b: TensorEntry) -> bool:
    """``a`` and ``b`` hold the same bytes: by their CRC-32s where they tell (no tensor read, no torch),
    else read and compared."""
    by_crc = _same_crcs(a, b)
    if by_crc is not None:
        return by_crc
    import torch

    from zckpt.stream import spans

    return all(
        torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(spans.iter_chunks(a), spans.iter_chunks(b), strict=True)
    )


def _ties(ckpt: Checkpoint, mds: dict[str, DcpMetadata]) -> list[Problem]:
    """Each tied alias's own stored chunks hold its owner's bytes (``mds``: the folders' metadata, parsed)."""
    out: list[Problem] = []
    if not ckpt.meta.tied:
        return out
    by_name = {}
    for folder in ckpt.meta.extra.get("folders") or []:
        f = location(folder)
        ld = model_of(f, mds.get(str(f)))
        for k in ld.keys:
            s = classify(ld.paths[k], k in ld.tensors)
            if s.kind == "model" and s.name in ckpt.meta.tied:
                t = ld.tensors[k]
                by_name[s.name] = TensorEntry(s.name, t.shape, t.dtype, Role.PARAM, pieces(ld, k))
    for alias, owner in ckpt.meta.tied.items():
        a, o = by_name.get(alias), ckpt.entries[owner]
        same = a is not None and a.shape == o.shape and _same_bytes(a, o)
        if not same:
            out.append(Problem(ckpt.meta.path, f"tied {alias!r:.80} does not hold the bytes of {owner!r:.80}",
                               "inconsistent", "the checkpoint's tie was broken after saving"))  # fmt: skip
    return out


def verify(path: Location, ckpt: Checkpoint | None, ctx: VerifyContext) -> list[Problem]:
    """The DCP checks (see the module doc); the reader's own errors are already reported."""
    try:
        src = layout.resolve(location(path), ctx.tag)
    except ZckptError:
        return []
    out: list[Problem] = []
    mds: dict[str, DcpMetadata] = {}
    for folder in src.folders if src.layout != "hf-shards" else ():
        try:
            md = mds[str(folder)] = load_metadata(folder)
        except ZckptError:
            continue
        out += _items(md, ctx) + _tiling(md) + _strays(md)
        if ckpt is None:  # the generic checks did not see these files: their sidecars are checked here
            for f in sorted({str(folder / i.file) for i in md.storage.values()}):
                if fileio.is_file(f) and f not in ctx.broken:
                    out += check_sidecar(location(f), ctx)
    if ckpt is not None and not out:
        out += _ties(ckpt, mds)
    return out
