"""torch ``.bin`` / ``.pt`` state dicts: lazy reading through ``zckpt.codecs.torchzip``; streaming writing.

Reading never runs ``torch.load``: the pickle goes through the allowlisted ``SafeUnpickler`` and each
tensor becomes pieces pointing into its storage record. Accepted layouts: a plain state dict, or a
dict holding one under ``state_dict`` / ``model`` / ``module`` / ``model_state_dict``, or model tensors at
the root beside nested dicts (torchtitan's ``dcp_to_torch_save`` output); non-tensor values are skipped and
listed in ``meta.extra["skipped"]``. An optimizer state dict saved beside the model under
``optim``/``optimizer`` (``get_optimizer_state_dict``'s FQN-keyed or torchtitan's flattened form) gives
``<fqn>:<state>`` entries. Names sharing storage, offset, shape and stride are tied aliases of the first
such name. Roles come from the ``zckpt.json`` record our writer adds; otherwise floating tensors are params
and the rest buffers (a ``.bin`` cannot tell more).

Writing (``write_torch``) produces archives that ``torch.load(weights_only=True)`` reads: one
storage record per tensor, streamed in bounded chunks; tied aliases share their owner's storage.
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zckpt.checkpoint import Checkpoint
from zckpt.codecs import torchzip
from zckpt.codecs.pickle_safe import TensorRef
from zckpt.errors import CorruptCheckpoint, KeyMappingError, Unsupported
from zckpt.formats import _flat
from zckpt.formats._names import HF_WEIGHT_BASES, PUBLISH_ORDER
from zckpt.formats.base import Format, ModelWriteOptions, ModelWriter
from zckpt.model import Piece, Role, TensorEntry
from zckpt.state import CheckpointMeta, Counters, TrainingState
from zckpt.storage import fileio
from zckpt.storage.digest import BLOCK_BYTES, FileDigest
from zckpt.storage.location import Location, location
from zckpt.storage.objstore import RemotePath
from zckpt.stream.shards import family, planned_names, write_sharded

if TYPE_CHECKING:  # writers stream tensors (torch); reading needs none
    from zckpt.stream.items import WriteItem

NAME = "torch"
SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
STATE_DICT_KEYS = ("state_dict", "model", "module", "model_state_dict")
OPTIM_KEYS = ("optim", "optimizer", "optimizer_state_dict")
RECORD_NAME = "zckpt.json"
BIN = "pytorch_model.bin"
MAX_RUNS = 1 << 16


# ---- reading -------------------------------------------------------------------------------------
def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and any(isinstance(v, TensorRef) for v in obj.values())
        and all(isinstance(k, str) for k in obj)
        and not any(isinstance(v, dict) for v in obj.values())
    )


def _find_state_dict(obj: Any, path: Location) -> tuple[dict[str, Any], str | None]:
    if _is_state_dict(obj):
        return obj, None
    if isinstance(obj, dict):
        for k in STATE_DICT_KEYS:
            if _is_state_dict(obj.get(k)):
                return obj[k], k
        root = {k: v for k, v in obj.items() if isinstance(k, str) and not isinstance(v, dict)}
        if _is_state_dict(root):  # model tensors at the root beside nested state (torchtitan's .pt)
            return root, ""
    keys = ", ".join(map(str, list(obj)[:8])) if isinstance(obj, dict) else type(obj).__name__
    raise Unsupported(
        f"{path}: no state dict found (top level: {keys})",
        hint="expected a dict of tensors, or one under 'state_dict', 'model' or 'module'",
        path=str(path),
    )


def _refuse_rank_file(obj: Any, path: Location) -> None:
    """A DeepSpeed rank file alone holds one rank's partitions (or 16-bit weights beside fp32 masters kept
    elsewhere): read as a state dict it would be a wrong model. Refuse it, naming the folder to give."""
    if (
        isinstance(obj, dict)
        and ("ds_version" in obj or "ds_config" in obj)
        and ("module" in obj or "optimizer_state_dict" in obj)
    ):
        raise KeyMappingError(
            f"{path}: one rank file of a DeepSpeed checkpoint; alone it is not the trained model",
            hint=f"give the folder that holds it ({path.parent}) or the folder holding `latest`",
            path=str(path),
        )


def _runs(ref: TensorRef, path: Location, name: str) -> list[tuple[int, int]]:
    """(storage element offset, length) of each contiguous run of ``ref``, in logical order."""
    shape, stride = ref.shape, ref.stride
    k, run = len(shape), 1
    while k > 0 and (shape[k - 1] == 1 or stride[k - 1] == run):
        run *= shape[k - 1]
        k -= 1
    if math.prod(shape[:k]) > MAX_RUNS:
        raise Unsupported(
            f"{path}: tensor {name!r} is a scattered view (stride {stride})",
            hint="re-save it with .contiguous()",
            path=str(path),
        )
    offsets = [ref.offset]
    for d in range(k):
        offsets = [o + i * stride[d] for o in offsets for i in range(shape[d])]
    runs = [(o, run) for o in offsets] if math.prod(shape) else [(ref.offset, 0)]
    for o, n in runs:
        if o < 0 or o + n > ref.storage.numel:
            raise CorruptCheckpoint(f"{path}: tensor {name!r} reaches past its storage", path=str(path))
    return runs


def _zckpt_record(path: Location) -> dict[str, Any]:
    try:
        with fileio.open_regular(path) as f, zipfile.ZipFile(f) as zf:
            names = [n for n in zf.namelist() if n.rpartition("/")[2] == RECORD_NAME]
            if not names:
                return {}
            rec = json.loads(zf.read(names[0]))
    except (ValueError, UnicodeDecodeError, RecursionError, zipfile.BadZipFile, OSError):
        raise CorruptCheckpoint(f"{path}: unreadable {RECORD_NAME} record", path=str(path)) from None
    return rec if isinstance(rec, dict) else {}


def _optimizer_tensors(obj: Any) -> dict[str, TensorRef]:
    """``{"<fqn>:<state>": tensor}`` of an optimizer state dict saved beside the model (``optim`` /
    ``optimizer``): ``{"state": {fqn: {k: tensor}}}`` (``get_optimizer_state_dict``) or torchtitan's flattened
    ``{"state.<fqn>.<k>": tensor}``. Integer-keyed states (a bare ``optimizer.state_dict()``) name no
    parameter and are skipped."""
    opt = next((obj[k] for k in OPTIM_KEYS if isinstance(obj, dict) and isinstance(obj.get(k), dict)), None)
    if opt is None:
        return {}
    out: dict[str, TensorRef] = {}
    state = opt.get("state")
    if isinstance(state, dict):
        for fqn, st in state.items():
            if isinstance(fqn, str) and isinstance(st, dict):
                out.update({f"{fqn}:{k}": v for k, v in st.items() if isinstance(v, TensorRef)})
    for key, v in opt.items():
        fqn, dot, k = key.removeprefix("state.").rpartition(".") if isinstance(key, str) else ("", "", "")
        if isinstance(v, TensorRef) and key.startswith("state.") and dot and fqn and k:
            out[f"{fqn}:{k}"] = v
    return out


def file_entries(
    path: Location, *, trust_pickle: bool = False
) -> tuple[list[TensorEntry], dict[str, str], dict[str, Any]]:
    """(entries, tied aliases, extra) of one torch zip file; reads only the pickle and zip directory."""
    obj = torchzip.load_refs(str(path), trust_pickle=trust_pickle)
    _refuse_rank_file(obj, path)
    try:
        sd, container = _find_state_dict(obj, path)
    except Unsupported:
        if not _optimizer_tensors(obj):
            raise
        sd, container = {}, ""  # an optimizer state dict alone (accelerate's optimizer_0 .pt)
    roles = _zckpt_record(path).get("roles") or {}
    if not isinstance(roles, dict):
        raise CorruptCheckpoint(f"{path}: {RECORD_NAME} roles must be an object", path=str(path))
    entries: list[TensorEntry] = []
    tied: dict[str, str] = {}
    owners: dict[tuple[str, int, tuple[int, ...], tuple[int, ...]], str] = {}
    skipped = []
    optim = _optimizer_tensors(obj) if container is not None else {}
    for name, ref in [*sd.items(), *optim.items()]:
        if not isinstance(ref, TensorRef):
            skipped.append(name)
            continue
        sig = (ref.storage.key, ref.offset, ref.shape, ref.stride)
        if ref.numel and sig in owners and name not in optim:
            tied[name] = owners[sig]
            continue
        owners[sig] = name
        base = ref.byte_offset - ref.offset * ref.dtype.itemsize
        pieces, start = [], 0
        for o, n in _runs(ref, path, name):
            pieces.append(
                Piece(str(path), base + o * ref.dtype.itemsize, ref.dtype, start, n, check=ref.check)
            )
            start += n
        role = Role.OPTIM if name in optim else _flat.role_of(name, ref.dtype, roles, path)
        entries.append(_flat.entry_of(name, ref.shape, ref.dtype, role, tuple(pieces), path))
    extra: dict[str, Any] = {"container": container, "skipped": skipped}
    if isinstance(obj, dict):
        for k in ("global_step", "step", "iteration"):
            if isinstance(obj.get(k), int):
                extra["step"] = obj[k]
                break
    return entries, tied, extra


# ---- writing -------------------------------------------------------------------------------------
def write_file(
    path: Path,
    items: Sequence[WriteItem],
    *,
    tied: Mapping[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> FileDigest:
    """Stream ``items`` into a new torch zip file (plus its ``.sha256.json`` block-digest sidecar); returns
    its digest."""
    from zckpt.codecs.torchzip_write import StorageSlot, TensorSlot, TorchZipWriter, dumps

    slots = {
        it.name: TensorSlot(StorageSlot(str(i), it.dtype, it.numel), it.shape) for i, it in enumerate(items)
    }
    sd: dict[str, TensorSlot] = dict(slots)
    aliases = {a: o for a, o in (tied or {}).items() if o in slots}
    for alias, owner in aliases.items():
        sd[alias] = slots[owner]
    roles = {it.name: it.role.value for it in items if it.role is not Role.PARAM}
    from zckpt.storage.sink import HashingSink  # the write path: reading needs none

    sink = HashingSink(path, block=BLOCK_BYTES)  # its sidecar: block digests, hashed on several cores
    try:
        zw = TorchZipWriter(sink)
        zw.write_header_records(dumps(sd))
        zw.write_bytes(RECORD_NAME, json.dumps({"roles": roles, "tied": aliases}, sort_keys=True).encode())
        for it in items:
            key = slots[it.name].storage.key

            def counted(it: WriteItem = it) -> Any:
                for chunk in it.chunks():
                    yield chunk
                    if on_bytes is not None:
                        on_bytes(chunk.numel() * chunk.element_size())

            zw.write_record(f"data/{key}", counted(), it.nbytes)
        zw.close()
    except BaseException:
        sink.abort()  # nothing of it appears (an object upload is aborted)
        raise
    sink.close()
    sink.write_sidecar()
    return sink.digest()


class BinWriter(ModelWriter):
    kind = "bin"
    suffixes = SUFFIXES
    base_name = BIN

    def write_into(
        self, folder: Path, base: str, items: Sequence[WriteItem], opts: ModelWriteOptions
    ) -> list[str]:
        """Aliases are listed in the index beside their owner (the ``.bin`` convention)."""

        def one(p: Path, shard: list[WriteItem]) -> FileDigest:
            return write_file(p, shard, tied=opts.tied, on_bytes=opts.on_bytes)

        return write_sharded(folder, base, items, opts.max_shard_size, one, aliases=opts.tied, part=opts.part)


def write_torch(
    out: str | Location,
    items: Sequence[WriteItem],
    *,
    tied: Mapping[str, str] | None = None,
    max_shard_size: int | None = None,
    overwrite: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Path] | list[RemotePath]:
    """Write tensors as a torch state dict to ``out`` (a ``.bin``/``.pt`` file or an HF folder), atomically.

    Tied aliases (``{alias: owner}``) are pickled as the owner's tensor, so after
    ``torch.load(weights_only=True)`` both names share one storage. Returns the final paths.
    """
    out = location(out)
    is_dir = out.suffix not in SUFFIXES
    base = BIN if is_dir else out.name
    from zckpt.storage.staging import open_staging

    with open_staging(
        out, is_dir=is_dir, overwrite=overwrite, owns=family(HF_WEIGHT_BASES), order=PUBLISH_ORDER
    ) as st:
        st.expect(planned_names(base, items, max_shard_size))
        BinWriter().write_into(
            st.dir, base, items, ModelWriteOptions(dict(tied or {}), max_shard_size, on_bytes)
        )
        return st.commit()


class TorchFileFormat(Format):
    """A torch ``.bin``/``.pt`` state dict (one file; HF folders of them are ``hf``'s)."""

    name = NAME

    @property
    def model_writer(self) -> ModelWriter:
        return BinWriter()

    def detect(self, path: Location) -> bool:
        return path.is_file() and (path.suffix in SUFFIXES or torchzip.is_torch_zip(str(path)))

    def read(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        entries, tied, extra = file_entries(path, trust_pickle=trust_pickle)
        state = TrainingState(counters=Counters(global_steps=extra.pop("step", None)))
        meta = CheckpointMeta(
            format=NAME,
            path=str(path),
            tied=tied,
            tied_files=dict.fromkeys(tied, str(path)),
            files=(str(path),),
            state=state,
            extra=extra,
        )
        return Checkpoint(meta, entries)


FORMAT = TorchFileFormat()
