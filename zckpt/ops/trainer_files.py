"""HF Trainer ``checkpoint-N`` folders: the files ``reshard`` carries beside the DeepSpeed (or native) state.

A save folder (the one holding ``latest``) with a ``trainer_state.json`` beside ``latest`` is a Trainer
checkpoint. The Trainer needs more than the ZeRO files to resume from it (``trainer_state.json``,
``scheduler.pt``, the per-rank RNG files) and keeps more (``training_args.bin``, config, tokenizer,
generation config, ``model.safetensors``, ``zero_to_fp32.py``), so the output folder gets:

- every regular file of the source save folder copied byte for byte (pickles are never unpickled; a link
  leading out of the folder is refused: ``storage.copied``),
  except ``latest`` (the writer's) and the files below; sub-folders are not copied (the tag folder is
  rewritten by the writer; other ones are named in a note);
- the RNG files mapped to the new ranks: new rank ``r`` takes old rank ``r % W_old``'s file, byte for byte,
  under the Trainer's name for the new world (``rng_state_{r}.pth``; ``rng_state.pth`` at world 1, as
  ``Trainer._save_rng_state`` / ``_load_rng_state`` name them);
- ``trainer_state.json`` copied, or, when the per-device batch changes to keep the global batch, rewritten
  in its ``train_batch_size`` value only (the Trainer compares it with ``per_device_train_batch_size`` on
  resume and restores it under ``auto_find_batch_size``). ``training_args.bin`` is never modified: the
  note says which per-device batch to pass when resuming.

A plain DeepSpeed save folder (``latest`` and no ``trainer_state.json``) resharded to DeepSpeed gets the
helper scripts DeepSpeed writes beside ``latest`` (``zero_to_fp32.py``, ``zero_to_torch.py``; ``HELPERS``)
copied byte for byte (``helper_scripts``); they are never run. Another output format gets none: they read
DeepSpeed's layout only.

Every change is a note in ``ReshardResult.notes``. ``plan`` runs on every process of a distributed reshard
(its ``digest`` is agreed on); only rank 0 calls ``write``, into the staging folder before ``latest``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zckpt.errors import CorruptCheckpoint
from zckpt.formats.base import OnFile
from zckpt.formats.deepspeed.layout import adjust_batch
from zckpt.ops import hf_files
from zckpt.state import CheckpointMeta
from zckpt.storage import copied, fileio
from zckpt.storage.location import Location, lexists, location, ordered, size
from zckpt.storage.objstore import RemotePath
from zckpt.storage.sink import HashingSink

TRAINER_STATE = "trainer_state.json"
LATEST = "latest"
HELPERS = ("zero_to_fp32.py", "zero_to_torch.py")
"""The scripts DeepSpeed's ``save_checkpoint`` copies beside ``latest`` (``_copy_recovery_script``)."""
MAX_STATE_BYTES = 256 << 20
"""Largest ``trainer_state.json`` read (its ``log_history`` grows with the run; a bound for hostile input)."""
_RNG = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
SMALL = frozenset((*hf_files.HF_FILES, *HELPERS, TRAINER_STATE, "scheduler.pt", "training_args.bin"))
"""Files of a Trainer folder that are kilobytes to megabytes (with the RNG files): one over
``hf_files.MAX_SIDE_FILE`` is refused before it is copied. The rest (weights the Trainer saved beside the
ZeRO state, files of other tools) are copied whatever their size."""
_CHUNK = 8 << 20
_SHOWN = 4
"""Mappings spelled out in the RNG note before it abbreviates."""


@dataclass(frozen=True)
class TrainerFiles:
    """What to put beside the resharded state: ``copies`` (output name -> source file, byte for byte) and
    ``trainer_state`` (the bytes of the output ``trainer_state.json``)."""

    copies: Mapping[str, Location]
    trainer_state: bytes | None
    """None: not a Trainer folder (a plain DeepSpeed folder's helper scripts only)."""
    notes: tuple[str, ...]
    batch_noted: bool = False
    """A note says how the batch changes and what to resume with (the writer's own batch note is then
    left out: one statement of one change)."""

    @property
    def digest(self) -> list[Any]:
        """What every process must agree on: the names, source sizes and the rewritten state's hash."""
        sizes = sorted((n, p.name, _size(p)) for n, p in self.copies.items())
        state = self.trainer_state
        return [sizes, None if state is None else hashlib.sha256(state).hexdigest()]

    def write(self, out: Path, on_file: OnFile) -> None:
        """Copy the files into the (staging) folder ``out``; ``on_file(name, bytes)`` after each."""
        for name, src in sorted(self.copies.items()):
            on_file(name, _copy(src, out / name))
        if self.trainer_state is None:
            return
        with HashingSink(out / TRAINER_STATE) as sink:
            sink.write(self.trainer_state)
        on_file(TRAINER_STATE, len(self.trainer_state))


def is_trainer_folder(save_dir: Location) -> bool:
    """``trainer_state.json`` beside ``latest``: an HF Trainer ``checkpoint-N`` folder."""
    return (save_dir / TRAINER_STATE).is_file() and (save_dir / LATEST).exists()


def plan(meta: CheckpointMeta, world: int) -> TrainerFiles | None:
    """The Trainer files of ``meta``'s save folder for an output at ``world`` ranks (None: not a Trainer
    folder)."""
    if meta.save_dir is None or not is_trainer_folder(location(meta.save_dir)):
        return None
    save_dir = location(meta.save_dir)
    files, folders = _listing(save_dir, meta.tag)
    rng = {n: p for n, p in files.items() if _RNG.match(n)}
    copies: dict[str, Location] = {
        n: p for n, p in files.items() if n not in rng and n not in (LATEST, TRAINER_STATE)
    }
    mapped, notes = _map_rng(rng, meta.world_size, world)
    copies.update(mapped)
    state_bytes, state_notes, batch_noted = _trainer_state(save_dir / TRAINER_STATE, meta, world)
    notes += state_notes
    dropped = sorted(f"{n}.sha256" for n in [*rng, TRAINER_STATE] if f"{n}.sha256" in copies)
    for n in dropped:  # a checksum of a file that is not copied as is would be wrong beside the output
        del copies[n]
    skipped = [f"{d}/" for d in folders] + dropped
    if skipped:
        notes.append(f"HF Trainer folder: not copied: {', '.join(skipped)}")
    return TrainerFiles(copies, state_bytes, tuple(notes), batch_noted)


def helper_scripts(meta: CheckpointMeta, dst_format: str) -> TrainerFiles | None:
    """A plain DeepSpeed save folder's helper scripts (``HELPERS``) for a DeepSpeed output, copied byte for
    byte and never run; None where there are none, the output is another format, or there is no save
    folder (a tag folder given alone)."""
    if dst_format != "deepspeed" or meta.format != "deepspeed" or meta.save_dir is None:
        return None
    save_dir = location(meta.save_dir)
    if not (save_dir / LATEST).is_file():
        return None
    copies = {n: copied.checked(save_dir / n, save_dir) for n in HELPERS if lexists(save_dir / n)}
    return TrainerFiles(copies, None, ()) if copies else None


def _listing(save_dir: Location, tag: str | None) -> tuple[dict[str, Location], list[str]]:
    """The save folder's files (name -> path; a link followed when its file is in the folder:
    ``copied.checked``) and its sub-folders other than the tag folder."""
    files: dict[str, Location] = {}
    folders: list[str] = []
    try:
        entries = ordered(save_dir.iterdir())
    except OSError as e:
        raise CorruptCheckpoint(
            f"{save_dir}: cannot list the HF Trainer folder ({e.strerror})", path=str(save_dir)
        ) from None
    for p in entries:
        if p.is_dir():
            if p.name != tag:
                folders.append(p.name)
        elif p.is_file():
            small = p.name in SMALL or _RNG.match(p.name) is not None
            files[p.name] = copied.checked(p, save_dir, hf_files.MAX_SIDE_FILE if small else None)
        else:
            raise CorruptCheckpoint(
                f"{p}: not a regular file (a broken link, FIFO or device) in the HF Trainer folder",
                hint="move it out of the checkpoint folder, or restore the file it stands for",
                path=str(p),
            )
    return files, folders


def _rng_name(rank: int, world: int) -> str:
    """The Trainer's RNG file of ``rank`` at ``world`` ranks (``Trainer._save_rng_state``)."""
    return "rng_state.pth" if world <= 1 else f"rng_state_{rank}.pth"


def _map_rng(rng: Mapping[str, Location], old: int, new: int) -> tuple[dict[str, Location], list[str]]:
    """New rank ``r`` takes old rank ``r % old``'s RNG file; notes saying so and naming any file left out."""
    pairs = [(_rng_name(r % old, old), _rng_name(r, new)) for r in range(new)]
    mapped = {dst: rng[src] for src, dst in pairs if src in rng}
    missing = sorted({src for src, _ in pairs if src not in rng})
    shown = [f"{s} -> {d}" for s, d in pairs if s in rng]
    more = f", ... ({len(shown)} files)" if len(shown) > _SHOWN else ""
    notes = []
    if shown:
        notes.append(
            f"HF Trainer RNG states: new rank r takes old rank r % {old}'s file, copied byte for byte: "
            + ", ".join(shown[:_SHOWN])
            + more
        )
    if missing:
        notes.append(
            f"HF Trainer RNG states: {', '.join(missing[:_SHOWN])} missing in the source; the ranks that "
            'take them get none (the Trainer then logs "Didn\'t find an RNG file" and resumes without)'
        )
    unused = sorted(set(rng) - {s for s, _ in pairs})
    if unused:
        notes.append(f"HF Trainer RNG states: not copied (no new rank takes them): {', '.join(unused)}")
    return mapped, notes


def _read_state(path: Location) -> tuple[bytes, dict[str, Any]]:
    hint = "restore the trainer_state.json the Trainer wrote"
    raw = fileio.read_capped(path, MAX_STATE_BYTES, "a trainer state", hint)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise CorruptCheckpoint(
            f"{path}: not a JSON object; the Trainer cannot resume from this folder",
            hint=hint,
            path=str(path),
        )
    return raw, doc


def _trainer_state(path: Location, meta: CheckpointMeta, world: int) -> tuple[bytes, list[str], bool]:
    """The output's ``trainer_state.json`` bytes (the source's, or with ``train_batch_size`` rewritten),
    the notes on the batch size and step, and whether one of them is about the batch."""
    raw, doc = _read_state(path)
    notes: list[str] = []
    step = doc.get("global_step")
    if meta.step is not None and step != meta.step:
        notes.append(
            f"{path}: global_step {step!r:.20} but the {meta.format} state is at step {meta.step}; the "
            "Trainer resumes its schedule and data at global_step (files of two saves mixed?)"
        )
    new_micro, batch_notes = _batch(meta.config or {}, doc.get("train_batch_size"), meta.world_size, world)
    notes += batch_notes
    if new_micro is None:
        return raw, notes, bool(batch_notes)
    return _set_key(path, raw, doc, "train_batch_size", new_micro), notes, bool(batch_notes)


def _as_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _batch(cfg: Mapping[str, Any], state_tbs: Any, old: int, new: int) -> tuple[int | None, list[str]]:
    """The new ``train_batch_size`` for ``trainer_state.json`` (None: unchanged) and the notes saying what
    to pass on resume. The per-device batch is the Trainer's own record (``train_batch_size``), else the
    config's micro batch. The rule is the DeepSpeed writer's (``adjust_batch``): keep the global batch and
    the gradient accumulation, change the per-device batch when it divides, else keep the per-device one."""
    cfg_micro = _as_int(cfg.get("train_micro_batch_size_per_gpu"))
    micro = _as_int(state_tbs) or cfg_micro
    gas = _as_int(cfg.get("gradient_accumulation_steps")) or 1
    if micro is None:
        return None, [
            "HF Trainer: the per-device batch is not recorded (no train_batch_size in trainer_state.json, "
            "no train_micro_batch_size_per_gpu); to keep the global batch, resume with "
            f"per_device_train_batch_size = global batch / ({new} ranks x gradient_accumulation_steps)"
        ]
    notes = []
    if state_tbs is not None and _as_int(state_tbs) is None:  # damaged or hand-edited: said, not used
        notes.append(
            f"HF Trainer: trainer_state.json train_batch_size {state_tbs!r:.40} is not a positive integer; "
            f"the batch below follows the config's train_micro_batch_size_per_gpu {micro}"
        )
    if cfg_micro is not None and cfg_micro != micro:
        notes.append(
            f"HF Trainer: trainer_state.json train_batch_size {micro} and the config's "
            f"train_micro_batch_size_per_gpu {cfg_micro} disagree; the batch below follows the Trainer's"
        )
    g_old = micro * gas * old
    resolved = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    got, _ = adjust_batch({**resolved, "train_batch_size": g_old}, old, new)
    new_micro = int(got["train_micro_batch_size_per_gpu"])
    if new_micro * gas * new != g_old:
        return None, [
            *notes,
            f"HF Trainer: the global batch {g_old} ({micro} per device x {old} ranks x grad accum {gas}) "
            f"cannot be kept at {new} ranks ({g_old} is not a multiple of {new} x {gas}); trainer_state.json "
            f"is unchanged: resuming with per_device_train_batch_size={micro} trains on global batches of "
            f"{new_micro * gas * new}, so the data order and losses differ from the original run's",
        ]
    if new_micro == micro:
        return None, notes
    rewrite = _as_int(state_tbs) is not None
    done = f": trainer_state.json train_batch_size rewritten {micro} -> {new_micro}" if rewrite else ""
    notes.append(
        f"HF Trainer: per-device batch {micro} -> {new_micro} keeps the global batch {g_old} ({new_micro} x "
        f"{new} ranks x grad accum {gas}){done}; resume with per_device_train_batch_size={new_micro} "
        f"(--per_device_train_batch_size {new_micro}; a DeepSpeed config that sets "
        f'train_micro_batch_size_per_gpu needs {new_micro} or "auto") and gradient_accumulation_steps={gas}; '
        "training_args.bin is copied unchanged (the original run's arguments; the Trainer does not read it "
        "on resume)"
    )
    return (new_micro if rewrite else None), notes


def _set_key(path: Location, raw: bytes, doc: dict[str, Any], key: str, value: int) -> bytes:
    """``raw`` with the top-level ``key`` set to ``value``: only its digits replaced when the key appears
    once in the text, else re-written the way the Trainer writes it (``indent=2, sort_keys=True``)."""
    want = {**doc, key: value}
    rx = re.compile(rb'("' + re.escape(key.encode()) + rb'"\s*:\s*)(-?\d+|null)')
    if len(rx.findall(raw)) == 1:
        out = rx.sub(lambda m: m.group(1) + str(value).encode(), raw)
        if json.loads(out) == want:
            return out
    out = (json.dumps(want, indent=2, sort_keys=True) + "\n").encode()
    if json.loads(out) != want:  # pragma: no cover - json round trip of parsed JSON
        raise CorruptCheckpoint(f"{path}: cannot rewrite {key}", path=str(path))
    return out


def _size(p: Location) -> int:
    try:
        return size(p)
    except OSError:
        return -1


def _copy(src: Location, dst: Path) -> int:
    """Copy the regular file (or object) ``src`` to the new file ``dst`` byte for byte (a file's mode bits
    kept); its size."""
    n = 0
    with fileio.open_regular(src) as fin, HashingSink(dst) as sink:
        want = fileio.file_size(fin)
        mode = None if isinstance(src, RemotePath) else stat.S_IMODE(os.fstat(fin.fileno()).st_mode)
        while chunk := fin.read(_CHUNK):
            n += sink.write(chunk)
    if n != want:
        raise CorruptCheckpoint(
            f"{src}: changed size while it was copied ({want} -> {n} bytes)",
            hint="reshard a checkpoint no process is writing to",
            path=str(src),
        )
    if mode is not None:
        os.chmod(dst, mode)
    return n
