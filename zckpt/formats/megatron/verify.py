"""``zckpt verify`` on Megatron ``torch_dist`` iteration folders: DCP's item checks plus Megatron's files.

From ``.metadata`` alone (so it reports damage the reader could not open past): every item's file present
and its bytes inside it, every embedded archive's CRC-32s, every tensor's boxes tiling it (DCP's checks,
``zckpt.formats.dcp.verify``); ``common.pt``'s zip records and CRC-32s; no stray files (anything but
``.metadata``, the files it names, ``common.pt``, ``metadata.json`` and sidecars).
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from zckpt.errors import ZckptError
from zckpt.formats.dcp.metadata import METADATA, load_metadata
from zckpt.formats.dcp.verify import _items, _tiling
from zckpt.formats.megatron.common import load_common
from zckpt.formats.megatron.layout import COMMON, MARKER
from zckpt.storage import fileio
from zckpt.storage.location import Location, ordered
from zckpt.stream.integrity import SIDECARS, Problem, VerifyContext, problem_from


def verify(folder: Location, ctx: VerifyContext) -> list[Problem]:
    """The checks of the module doc on iteration folder ``folder``."""
    out: list[Problem] = []
    try:
        md = load_metadata(folder)
    except ZckptError as e:
        return [problem_from(e, folder / METADATA)]
    out += _items(md, ctx) + _tiling(md)
    named = {Path(i.file).name for i in md.storage.values()} | {METADATA, COMMON, MARKER}
    named |= {n + side for n in named for side in SIDECARS}
    for f in ordered(folder.iterdir()):
        if f.is_file() and f.name not in named:
            why = "not named by .metadata (a leftover of another save, or a file copied in)"
            out.append(Problem(str(f), why, "stale", "move it away"))
    out += _common(folder / COMMON, ctx)
    return out


def _common(f: Location, ctx: VerifyContext) -> list[Problem]:
    """``common.pt``: its pickle through the Megatron allowlist, every zip record's CRC-32."""
    if not f.is_file():
        return [Problem(str(f), "missing (args, iteration and optimizer groups live in it)", "missing",
                        "restore the file from the original save")]  # fmt: skip
    try:
        load_common(f.parent, trust_pickle=ctx.trust)
        with fileio.open_regular(f) as fh, zipfile.ZipFile(fh) as zf:  # a file, or an object in a store
            bad = zf.testzip()
    except ZckptError as e:
        return [problem_from(e, f)]
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return [Problem(str(f), f"damaged zip ({e})", "corrupt", "restore the file from the original save")]
    if bad is not None:
        return [Problem(str(f), f"record {bad} fails its CRC-32", "checksum",
                        "restore the file from the original save")]  # fmt: skip
    return []
