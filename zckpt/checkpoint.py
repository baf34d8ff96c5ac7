"""The lazy ``Checkpoint``: a checkpoint's entries and manifest (``zckpt.model``) plus on-demand reads.

Every format reader returns one; every operation works on one. Tensor bytes are read only when asked
for, one tensor at a time, through ``zckpt.storage.fileio`` (``pread`` of exactly that tensor's pieces), with
the ``zckpt.storage.session.Storage`` it was opened with (``attach``): its open files, its object-store client
and the listings it saw, one consistent view for the checkpoint's lifetime.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from zckpt.errors import CorruptCheckpoint, MissingKey
from zckpt.model import Role, TensorEntry
from zckpt.state import CheckpointMeta
from zckpt.storage import fileio, session

if TYPE_CHECKING:  # torch is imported by the first tensor read (``zckpt.stream.spans``): metadata needs none
    import torch


def _file_of(e: TensorEntry, default: str) -> str:
    return e.pieces[0].file if e.pieces else default


class Checkpoint(Mapping[str, "torch.Tensor"]):
    """A lazily read checkpoint. A ``Mapping`` of model tensors (params, frozen params, buffers and
    tied aliases) keyed by state-dict name; ``ckpt[name]`` reads that one tensor.

    The mapping is exactly the model: ``key in ckpt``, ``ckpt[key]``, ``iter``, ``len``, ``keys()``,
    ``items()`` and ``==`` agree (``collections.abc.Mapping``'s laws). Optimizer states
    (``"<param>:<state>"``) are no keys of it: they are reached through ``optim_keys()`` and
    ``read(key)`` (``ckpt["w:exp_avg"]`` is a ``KeyError`` whose hint says so), and ``entries`` holds
    every tensor's entry.
    """

    def __init__(self, meta: CheckpointMeta, entries: list[TensorEntry]) -> None:
        self.meta = meta
        self.entries: dict[str, TensorEntry] = {}
        for e in entries:
            if e.key in self.entries:
                first, again = _file_of(self.entries[e.key], meta.path), _file_of(e, meta.path)
                also = f" (also in {Path(first).name})" if first != again else ""
                raise CorruptCheckpoint(f"{again}: tensor {e.key!r:.80} appears twice{also}", path=again)
            self.entries[e.key] = e
        for alias, owner in meta.tied.items():
            where = meta.tie_file(alias)
            if owner not in self.entries:
                what = "another alias" if owner in meta.tied else "missing owner"
                raise CorruptCheckpoint(
                    f"{where}: tied alias {alias!r:.80} names {what} {owner!r:.80}",
                    hint="the tie metadata is damaged",
                    path=where,
                )
            if alias in self.entries:
                raise CorruptCheckpoint(
                    f"{where}: tied alias {alias!r:.80} is also a tensor of its own",
                    hint="the tie metadata is damaged",
                    path=where,
                )
        self._model_keys = [k for k, e in self.entries.items() if e.role.is_model]
        self._model_keys += [a for a in meta.tied if a not in self.entries]
        self.storage: session.Storage | None = None
        """What its bytes are read through (``attach``)."""
        self._owns_storage = False

    def attach(self, st: session.Storage, *, owned: bool) -> None:
        """Read through ``st`` from now on; ``owned``: ``close`` closes it (else only this checkpoint's
        files in it)."""
        self.storage, self._owns_storage = st, owned

    # -- Mapping -------------------------------------------------------------------------------
    def __getitem__(self, key: str) -> torch.Tensor:
        """``ckpt[name]``: read one model tensor; a name that is no model tensor (an optimizer state
        included) raises ``MissingKey``, a ``KeyError``."""
        if key not in self:
            e = self.entries.get(key) if isinstance(key, str) else None
            if e is not None:  # an optimizer state: in the checkpoint, not in the model mapping
                raise MissingKey(
                    f"{self.meta.path}: {key!r} is an optimizer state, not a model tensor",
                    hint=f"read it with ckpt.read({key!r}); ckpt.optim_keys() lists them",
                )
            raise MissingKey(f"{self.meta.path}: no tensor {key!r}", hint="`zckpt inspect` lists the keys")
        return self.read(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._model_keys)

    def __len__(self) -> int:
        return len(self._model_keys)

    def __contains__(self, key: object) -> bool:
        """A model tensor's name (tied aliases included); optimizer states are not keys (class doc)."""
        if not isinstance(key, str):
            return False
        e = self.entries.get(key)
        return e.role.is_model if e is not None else key in self.meta.tied

    # -- lazy access ---------------------------------------------------------------------------
    def entry(self, key: str) -> TensorEntry:
        """The entry for ``key``; tied aliases resolve to their owner."""
        owner = self.meta.tied.get(key, key)
        try:
            return self.entries[owner]
        except KeyError:
            raise MissingKey(  # a KeyError: ``ck.get(name, default)`` and ``except KeyError`` work (Mapping)
                f"{self.meta.path}: no tensor {key!r}", hint="`zckpt inspect` lists the keys"
            ) from None

    def optim_keys(self) -> list[str]:
        """Keys of the optimizer states (``<param name>:<state>``), in checkpoint order."""
        return [k for k, e in self.entries.items() if e.role is Role.OPTIM]

    def model_entries(self) -> list[TensorEntry]:
        """Owner entries of model tensors (no aliases), in checkpoint order."""
        return [e for e in self.entries.values() if e.role.is_model]

    def read(self, key: str | TensorEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Read one logical tensor (and nothing else) into memory, optionally cast: any key of ``entries``
        (model tensors and optimizer states ``"<param>:<state>"``), a tied alias or an entry."""
        from zckpt.stream import spans

        e = key if isinstance(key, TensorEntry) else self.entry(key)
        if self.storage is None or session.bound_storage() is self.storage:
            return spans.read_entry(e, dtype)
        with self.storage.bound():
            return spans.read_entry(e, dtype)

    def close(self) -> None:
        """Release the open files and maps (also on leaving a ``with`` block), and the storage it made."""
        st = self.storage
        if st is None:
            fileio.close_files(self.meta.files)
        elif self._owns_storage:
            st.close()
        else:
            st.files.close(self.meta.files)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        m = self.meta
        return (
            f"Checkpoint(format={m.format!r}, path={m.path!r}, world_size={m.world_size}, stage={m.stage}, "
            f"tensors={len(self)}, optim_states={len(self.optim_keys())})"
        )
