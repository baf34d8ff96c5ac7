"""The engine's native checkpoint format (spec: docs/native-format.md): ``<save_dir>/latest``,
``<save_dir>/<tag>/manifest.json`` and one ``rank_{r:05d}.safetensors`` per rank; no pickle anywhere.

``layout`` names files and keys and types the manifest; ``read`` opens a checkpoint (cross-checking the
manifest against every rank file); ``write`` is the one writer, shared by the engine and reshard.
"""

from __future__ import annotations

import functools

from zckpt.checkpoint import Checkpoint
from zckpt.errors import ZckptError
from zckpt.formats.base import CheckpointWriter, Format
from zckpt.formats.native import layout
from zckpt.formats.native.read import detect, load_manifest, read, resolve
from zckpt.storage.location import Location, ordered
from zckpt.storage.location import size as size_of
from zckpt.stream.integrity import Problem, VerifyContext, compare_digest


class NativeFormat(Format):
    name = "native"
    training = True

    @functools.cached_property
    def writer(self) -> CheckpointWriter:
        from zckpt.formats.native.write import NativeWriter

        return NativeWriter()

    def detect(self, path: Location) -> bool:
        return detect(path)

    def read(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        return read(path, tag=tag)

    def verify(self, path: Location, ckpt: Checkpoint | None, ctx: VerifyContext) -> list[Problem]:
        """Every file the manifest lists present, of the recorded size and digest; no rank file the manifest
        does not list (but those of another generation: an unfinished save's, in a bucket); one rank file per
        rank of the recorded world size."""
        try:
            td = resolve(path, ctx.tag)[1]
            man = load_manifest(td)
        except ZckptError:
            return []  # the reader already reported it
        out: list[Problem] = []
        for name, (digest, size) in sorted(man.files.items()):
            f = td / name
            if not f.is_file():
                out.append(Problem(str(f), "missing (listed in manifest.json)", "missing"))
            elif str(f) not in ctx.broken and (have := size_of(f)) != size:
                kind = "truncated" if have < size else "corrupt"
                out.append(Problem(str(f), f"{have} bytes but manifest.json records {size}", kind))
            elif str(f) not in ctx.broken:
                out += compare_digest(f, digest, size, layout.MANIFEST, ctx)
        for f in ordered(td.glob("rank_*.safetensors")):
            # a rank file of another generation than the manifest's: an unfinished save's leftover in a
            # bucket, never read as part of this one (the manifest names its generation); the next save of
            # the tag deletes it
            m = layout.RANK_FILE.fullmatch(f.name)
            if m and f.name not in man.files and not (m.group(1) and m.group(1)[1:] != man.generation):
                out.append(
                    Problem(
                        str(f),
                        "rank file not listed in manifest.json (stale from another save?)",
                        "stale",
                        "move it away",
                    )
                )
        ranks = {n for n in man.files if n in {man.rank_file(r) for r in range(man.world_size)}}
        if len(ranks) != man.world_size:
            out.append(
                Problem(
                    str(td / layout.MANIFEST),
                    f"lists {len(ranks)} rank files for world size {man.world_size}",
                    "inconsistent",
                )
            )
        return out


FORMAT = NativeFormat()
__all__ = ["FORMAT", "NativeFormat", "layout", "load_manifest", "resolve"]
