"""The contract every on-disk format implements, and the writer contracts the operations call.

A format is one module (or package) under ``zckpt/formats/`` exposing ``FORMAT``, an instance of a
``Format`` subclass: ``name``, ``detect`` (cheap: names and headers only), ``read`` (a lazy
``Checkpoint``: metadata now, tensor bytes on demand) and ``verify`` (its own integrity checks beyond the
file-level ones every file gets). A format that can be written adds a writer:

- ``CheckpointWriter``: a training checkpoint for a given world size (``zckpt reshard --to NAME``):
  ``plan`` decides the files, ``write_unit`` writes one independent part (processes of a distributed
  reshard split the units), ``finish`` writes what names them all (manifest, shared files, ``latest``).
- ``ModelWriter``: one loadable model (``zckpt consolidate``): a file, or HF-style shards and an index.

Operations only ever talk to these classes, so a new format is one new module plus one registry line.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from zckpt.checkpoint import Checkpoint
from zckpt.codecs.safetensors import FileRecord
from zckpt.storage.location import Location
from zckpt.stream.integrity import Problem, VerifyContext

if TYPE_CHECKING:
    from zckpt.stream.items import WriteItem

OnFile = Callable[[str, int], None]
"""Called with (file name relative to the output, bytes) after each file a writer finishes."""


@dataclass(frozen=True)
class WritePlan:
    """What a ``CheckpointWriter`` will write: the same on every process of a distributed run."""

    world: int
    stage: int | None
    """ZeRO stage of the output; None for a format that has none (DCP: what FSDP2 loads at any world)."""
    tag: str
    units: int
    """Independent parts (rank files) to write; process ``i`` of ``n`` writes units ``i::n``."""
    notes: tuple[str, ...] = ()
    """What the conversion changed that the user should know (batch size, dropped states)."""
    digest: tuple[object, ...] = field(default=(), compare=False)
    """Anything else every process must agree on (checked before writing)."""
    generation: str | None = None
    """A name part for the data files (``zckpt.storage.remote_staging.RemoteStaging.generation``: an output
    that replaces another in an object store), for writers whose completing file names them
    (``generations``)."""


class CheckpointWriter(abc.ABC):
    """Writes a training checkpoint of any ``Checkpoint`` for another world size."""

    generations: ClassVar[bool] = False
    """Its completing file names its data files, so they can carry ``WritePlan.generation``."""

    @abc.abstractmethod
    def plan(self, ckpt: Checkpoint, *, world: int, stage: int | None, tag: str) -> WritePlan: ...

    @abc.abstractmethod
    def write_unit(
        self, ckpt: Checkpoint, plan: WritePlan, out: Path, unit: int, on_file: OnFile
    ) -> list[FileRecord]:
        """Write part ``unit`` of the plan under the output folder ``out``; the records of its files."""

    @abc.abstractmethod
    def finish(
        self, ckpt: Checkpoint, plan: WritePlan, out: Path, records: Sequence[FileRecord], on_file: OnFile
    ) -> None:
        """Given every unit's records, write what completes the folder (run once, last; ``latest`` last)."""


@dataclass(frozen=True)
class ModelWriteOptions:
    """How a ``ModelWriter`` writes: tied aliases (``{alias: owner}``), shard size, progress callback, reader
    threads, and ``part=(rank, world)``: only this process's share of the shards (rank 0 also the index)."""

    tied: Mapping[str, str] = field(default_factory=dict)
    max_shard_size: int | None = None
    on_bytes: Callable[[int], None] | None = None
    workers: int | None = None
    part: tuple[int, int] = (0, 1)


class ModelWriter(abc.ABC):
    """Writes model tensors as one loadable model: a file, or shards plus an index in a folder."""

    kind: ClassVar[str]
    """What users call it (``--format``): ``safetensors``, ``bin``."""
    suffixes: ClassVar[tuple[str, ...]]
    """File suffixes that select this writer."""
    base_name: ClassVar[str]
    """The file name inside an HF folder (``model.safetensors``)."""

    @abc.abstractmethod
    def write_into(
        self, folder: Path, base: str, items: Sequence[WriteItem], opts: ModelWriteOptions
    ) -> list[str]:
        """Write ``base`` (or its shards and ``<base>.index.json``) into an existing folder; names written."""


class Format(abc.ABC):
    """One on-disk format (see the module doc)."""

    name: ClassVar[str]
    training: ClassVar[bool] = False
    """Its checkpoints are sharded training checkpoints (per-rank partitions, optimizer state)."""

    @property
    def writer(self) -> CheckpointWriter | None:
        """Writes this format's training checkpoints, or None. A format imports its writer here, on first
        use: reading a checkpoint (``inspect``, ``verify``) never imports torch or a writer."""
        return None

    @property
    def model_writer(self) -> ModelWriter | None:
        """Writes one loadable model in this format, or None (imported on first use, as ``writer``)."""
        return None

    @abc.abstractmethod
    def detect(self, path: Location) -> bool: ...

    @abc.abstractmethod
    def read(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint: ...

    def read_model(self, path: Location, *, tag: str | None = None, trust_pickle: bool = False) -> Checkpoint:
        """What a job that needs the model tensors only (consolidate) reads: by default all of ``read``; a
        format may leave out optimizer and training state it would otherwise have to locate (DCP: the
        thousands of archives of optimizer chunks and values). Its ``optim_keys()`` may then be empty."""
        return self.read(path, tag=tag, trust_pickle=trust_pickle)

    def verify(self, path: Location, ckpt: Checkpoint | None, ctx: VerifyContext) -> list[Problem]:
        """Format-specific integrity checks (the reader's own cross-checks already ran in ``read``)."""
        return []

    def hf_model(self, ckpt: Checkpoint) -> tuple[Checkpoint, Mapping[str, object]] | None:
        """For a format whose names are not Hugging Face's (Megatron): ``ckpt`` under HF names and the
        ``config.json`` that goes with it, which ``consolidate`` to a folder writes; None: write the names
        as they are (the default). Raises ``Unsupported`` when the model maps to no HF architecture."""
        return None
