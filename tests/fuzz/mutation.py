"""What a mutation is and the helpers every mutator shares.

A mutator is a small function ``(case_dir, rng) -> Mutation``: ``case_dir`` is a clean base folder
(``corpus.Base``: ``base.json``, ``ckpt/``, maybe ``donor/``); the mutator copies it into a fresh
temporary folder (``fresh_copy``) and damages the copy. The ``Mutation`` says what was done, which bytes
or fields it touched (``Touch``), whether a checksum of that format covers them, and what a correct tool
may answer:

- ``value_only``: only numbers a format cannot check changed (tensor payload without a checksum, a plain
  JSON value): exit 0 with a different output is acceptable ("ok-undetectable");
- ``inconsistent``: files or fields now disagree in a way a reader can see without checksums (structure
  broken, rank files mixed, manifest vs headers); ``verify`` must not say OK, ``diff`` must not say equal;
- ``must_refuse``: any exit 0 is wrong (a ``latest`` leaving the folder, one rank file given alone);
- ``scenario`` / ``argv`` / ``setup`` / ``checks``: mutations of the *invocation* (paths, signals) carry
  their own command line instead of the runner's standard ones.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fuzz.corpus import Base
from tests.fuzz.layout import Region

TMP_ROOT: Path | None = None
"""Where mutated copies are made (None: the system temporary folder); the suite sets it."""

TENSOR_SUFFIXES = (".pt", ".bin", ".safetensors")


@dataclass(frozen=True)
class Touch:
    """One place a mutation changed: a file (relative to the case root) and what in it.

    ``checksummed``: a checksum the format keeps would reveal the change (zip CRC-32 of a record whose bytes
    changed, a native manifest sha256 or ``.sha256`` sidecar of a file whose bytes changed). A record
    rewritten with a fresh CRC (re-pickled ``data.pkl``) or an unchecked file (``manifest.json``, an index,
    ``latest``) is not."""

    file: str
    what: str
    offset: int | None = None
    length: int | None = None
    checksummed: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Mutation:
    """A damaged copy of a base and how to judge a tool's answer on it (see the module docstring)."""

    family: str
    op: str
    detail: str
    base: str
    root: Path
    input: str
    touches: list[Touch] = field(default_factory=list)
    value_only: bool = False
    inconsistent: bool = False
    must_refuse: bool = False
    related: tuple[str, ...] = ()
    """File names (basenames, or name prefixes such as ``rank_0``) an error may name besides the touched
    files."""
    misleading: tuple[str, ...] = ()
    """Phrases an error about this damage must not use (they describe another problem)."""
    commands: tuple[str, ...] | None = None
    """Standard commands that make sense (None: every one the base supports)."""
    scenario: str | None = None
    argv: list[str] | None = None
    """Command line (without ``python -m zckpt.cli.app``) with ``{root}`` / ``{in}`` placeholders."""
    cwd: str | None = None
    setup: list[list[str]] = field(default_factory=list)
    checks: tuple[str, ...] = ()
    no_dac_override: bool = False
    """Run the command without CAP_DAC_OVERRIDE (root ignores chmod 000 otherwise)."""
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def checksummed(self) -> bool:
        return any(t.checksummed for t in self.touches)

    @property
    def names(self) -> tuple[str, ...]:
        """Basenames an error about this mutation may name."""
        touched = tuple(Path(t.file).name for t in self.touches if t.file)
        return tuple(dict.fromkeys(touched + self.related))

    def to_json(self) -> dict[str, Any]:
        return {
            "family": self.family, "op": self.op, "detail": self.detail, "base": self.base,
            "root": str(self.root), "input": self.input, "touches": [t.to_json() for t in self.touches],
            "checksummed": self.checksummed, "value_only": self.value_only,
            "inconsistent": self.inconsistent, "must_refuse": self.must_refuse,
            "scenario": self.scenario, "argv": self.argv, "cwd": self.cwd, "setup": self.setup,
        }  # fmt: skip


Mutator = Callable[[Path, random.Random], Mutation]

ALL_KINDS = ("deepspeed", "native", "safetensors", "hf", "bin", "hf-bin")
"""Every kind but ``dcp`` (its families are in ``tests.fuzz.dcp``)."""


class NotApplicable(Exception):
    """The mutator cannot damage this base this way; ``root`` (its copy, if made) is to be removed."""

    def __init__(self, root: Path | None, why: str) -> None:
        super().__init__(why)
        self.root = root


@dataclass(frozen=True)
class Op:
    """One mutator of a family and the base kinds it applies to."""

    name: str
    fn: Mutator
    kinds: tuple[str, ...] = ALL_KINDS
    needs_donor: bool = False
    min_tags: int = 1

    def applies(self, base: Base) -> bool:
        if base.kind not in self.kinds or (self.needs_donor and not base.donor):
            return False
        return self.min_tags <= max(1, len(base.tags))


def ops(kinds: tuple[str, ...], **mutators: Mutator) -> list[Op]:
    """``Op``s named after the keyword names (``_`` -> ``-``)."""
    return [Op(name.replace("_", "-"), fn, kinds) for name, fn in mutators.items()]


# ---- shared helpers ----------------------------------------------------------------------------------
def fresh_copy(case_dir: Path) -> tuple[Base, Path]:
    """(base, root): a private copy of the base folder to damage."""
    base = Base.load(case_dir)
    root = Path(tempfile.mkdtemp(prefix=f"fz-{base.name}-", dir=TMP_ROOT))
    for item in case_dir.iterdir():
        if item.is_dir():
            shutil.copytree(item, root / item.name, symlinks=True)
        else:
            shutil.copy2(item, root / item.name)
    (root / "out").mkdir()
    return base, root


def new(family: str, op: str, detail: str, base: Base, root: Path, **kw: Any) -> Mutation:
    return Mutation(family, op, detail, base.name, root, base.input, **kw)


def rel(root: Path, p: Path) -> str:
    return str(p.relative_to(root))


def tag_dir(base: Base, root: Path) -> Path:
    """The tag folder ``latest`` names, for sharded bases."""
    ckpt = root / "ckpt"
    return ckpt / (ckpt / "latest").read_text().strip()


def tensor_files(base: Base, root: Path) -> list[Path]:
    """The checkpoint's tensor files (the ones ``latest`` selects for sharded bases)."""
    where = tag_dir(base, root) if base.sharded else root / "ckpt"
    if (root / base.input).is_file():
        return [root / base.input]
    return sorted(p for p in where.iterdir() if p.is_file() and p.suffix in TENSOR_SUFFIXES)


def other_files(base: Base, root: Path) -> list[Path]:
    """Non-tensor files a reader consults: ``latest``, manifests, indexes, configs. For sharded bases, not
    the files of tags other than the one ``latest`` names: no command here reads them (they are another
    checkpoint of the save folder; damage there is not damage to the input)."""
    ckpt = root / "ckpt"
    if not ckpt.is_dir():
        return []
    out = [p for p in ckpt.rglob("*") if p.is_file() and p.suffix in (".json", "")]
    if base.sharded and (ckpt / "latest").is_file():
        read = tag_dir(base, root)
        others = [ckpt / t for t in base.tags if ckpt / t != read]
        out = [p for p in out if not any(o in p.parents for o in others)]
    return sorted(p for p in out if not p.name.endswith(".sha256"))


def covered(base: Base, path: Path) -> bool:
    """Whether a whole-file checksum covers ``path`` (native manifest or a ``.sha256`` sidecar)."""
    if path.suffix != ".safetensors" and path.suffix not in (".pt", ".bin"):
        return False
    native_rank = base.kind == "native" and path.name.startswith("rank_")
    return native_rank or path.with_name(path.name + ".sha256").is_file()


def region_touch(root: Path, path: Path, r: Region, offset: int, length: int) -> Touch:
    """A ``Touch`` of bytes inside region ``r`` of ``path`` (checksummed when the region is)."""
    return Touch(rel(root, path), f"{r.kind} {r.name}".strip(), offset, length, r.checksummed)


def pick_weighted(rng: random.Random, items: Sequence[Any], weights: Sequence[float]) -> Any:
    return rng.choices(list(items), weights=list(weights), k=1)[0]
