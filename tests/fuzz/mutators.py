"""Families of mutations and their registry. Each mutator is ``(case_dir, rng) -> Mutation`` (see
``tests.fuzz.mutation``): it copies a clean base and damages the copy.

This module owns the file-level families and the registry ``FAMILIES`` of every family:

- ``bytes``: bit flips, overwrites, truncations, insertions and deletions anywhere in any file, aimed by
  region (zip headers/records/directory, safetensors length/header/tensors, text) so rare regions get hit;
- ``zip``: torch zip archives only: storage-record flips (CRC now wrong), ``data.pkl`` flips, directory and
  local-header name flips, CRC and size field flips;
- ``latest``: the tag pointer: ``../x``, absolute paths, NUL bytes, binary, very long, empty, missing tag;
- ``special``: special files in place of a checkpoint file: FIFO, ``/dev/zero`` symlink, folder, chmod 000
  (run without CAP_DAC_OVERRIDE when root), dangling symlink, symlink loop, 64 GiB sparse file;
- ``ranks``: rank files swapped, replaced by the same rank's file of another step or run, dropped,
  duplicated, an extra rank, or one rank file given alone;

and takes the parseable structural families from ``tests.fuzz.structural`` (``ds-pickle``, ``pickle-bomb``,
``manifest``, ``st-header``, ``hf-index``), the invocation families from ``tests.fuzz.scenarios``
(``paths``, ``signals``) and, run only when named, the DCP, Megatron and ``side-files`` families.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

from tests.fuzz import dcp, layout, megatron, scenarios, side_files, structural
from tests.fuzz.corpus import Base
from tests.fuzz.mutation import (
    ALL_KINDS,
    Mutation,
    Mutator,
    NotApplicable,
    Op,
    Touch,
    covered,
    fresh_copy,
    new,
    ops,
    other_files,
    region_touch,
    rel,
    tag_dir,
    tensor_files,
)

SHARDED = ("deepspeed", "native")
ZIPPED = ("deepspeed", "bin", "hf-bin")
ALL = ALL_KINDS


# ---- bytes ---------------------------------------------------------------------------------------------
def _pick_file(base: Base, root: Path, rng: random.Random) -> Path:
    tensors, others = tensor_files(base, root), other_files(base, root)
    if others and rng.random() < 0.15:
        return rng.choice(others)
    return rng.choice(tensors)


def _pick_region(path: Path, base: Base, rng: random.Random) -> layout.Region:
    regs = layout.file_regions(path, whole_file_checksum=covered(base, path))
    kinds = sorted({r.kind for r in regs})
    kind = rng.choice(kinds)
    return rng.choice([r for r in regs if r.kind == kind])


def _edit(data: bytearray, edit: str, at: int, n: int, rng: random.Random) -> int:
    """Apply ``edit`` at byte ``at`` (``n`` bytes where it takes a length); returns the bytes touched."""
    if edit == "flip":
        was = data[at]
        for _ in range(rng.randint(1, 3)):
            data[at] ^= 1 << rng.randrange(8)
        if data[at] == was:  # the flips cancelled out: a byte left as it was is no mutation
            data[at] ^= 1 << rng.randrange(8)
        return 1
    if edit == "overwrite":
        data[at : at + n] = bytes(rng.choice((0x00, 0xFF, rng.randrange(256))) for _ in range(n))
    elif edit == "truncate":
        n = len(data) - at
        del data[at:]
    elif edit == "insert":
        data[at:at] = rng.randbytes(n)
    else:
        del data[at : at + n]
    return n


def _byte_op(edit: str) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        path = _pick_file(base, root, rng)
        r = _pick_region(path, base, rng)
        data = bytearray(path.read_bytes())
        at = rng.randrange(r.start, r.end)
        n = _edit(data, edit, at, min(r.end - at, rng.randint(1, 16)), rng)
        path.write_bytes(bytes(data))
        sized = edit in ("flip", "overwrite")
        # unchecked text, or a size-preserving edit of an unchecked safetensors file (no redundancy: a result
        # that still parses is just another valid file): any exit-0 output may be a legitimate one
        free = r.kind == "text" or (sized and path.suffix == ".safetensors" and not r.checksummed)
        detail = f"{edit} {n} byte(s) at {at} of {path.name} ({r.kind} {r.name})".strip()
        return new("bytes", edit, detail, base, root, touches=[region_touch(root, path, r, at, n)],
                   value_only=free or (sized and r.value),
                   inconsistent=not sized and r.kind != "text")  # fmt: skip

    return mutate


# ---- zip -----------------------------------------------------------------------------------------------
def _zip_file(base: Base, root: Path, rng: random.Random) -> Path:
    return rng.choice([p for p in tensor_files(base, root) if layout.is_zip(p)])


def _zip_flip(op: str, kinds: tuple[str, ...], *, storage: bool | None = None) -> Mutator:
    """Flip one bit inside a region of one of ``kinds`` (``storage``: only tensor records / only others)."""

    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        path = _zip_file(base, root, rng)
        regs = [r for r in layout.file_regions(path) if r.kind in kinds]
        if storage is not None:
            regs = [r for r in regs if r.value == storage] or regs
        r = rng.choice(regs)
        data = bytearray(path.read_bytes())
        at = rng.randrange(r.start, r.end)
        bit = rng.randrange(8)
        data[at] ^= 1 << bit
        path.write_bytes(bytes(data))
        return new("zip", op, f"flip bit {bit} of byte {at} of {path.name} ({r.kind} {r.name})", base, root,
                   touches=[region_touch(root, path, r, at, 1)], value_only=r.value,
                   inconsistent=not r.value)  # fmt: skip

    return mutate


def _zip_field(op: str, field_offset: int, width: int) -> Mutator:
    """Flip a bit of a fixed header field (CRC-32, sizes) of a central-directory entry."""

    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        path = _zip_file(base, root, rng)
        entries = [r for r in layout.file_regions(path) if r.kind == "zip-dir-entry"]
        r = rng.choice(entries)
        data = bytearray(path.read_bytes())
        at = r.start + field_offset + rng.randrange(width)
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return new("zip", op, f"{op} of {r.name} in {path.name} (byte {at})", base, root,
                   touches=[region_touch(root, path, r, at, 1)], inconsistent=True)  # fmt: skip

    return mutate


# ---- latest --------------------------------------------------------------------------------------------
def _escape_target(base: Base, root: Path) -> Path:
    """A valid checkpoint outside the save folder: the donor's tag (other values) or a copy of ours."""
    other = root / "other"
    src = root / base.donor / "global_step3" if base.donor else tag_dir(base, root)
    shutil.copytree(src, other / "global_step3")
    return other / "global_step3"


def _latest(op: str, must_refuse: bool = True) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        latest = root / "ckpt" / "latest"
        content: bytes = {
            "dotdot": lambda: b"../other/global_step3",
            "absolute": lambda: str(_escape_target(base, root)).encode(),
            "nul": lambda: b"global_step3\x00" + rng.randbytes(4).hex().encode(),
            "binary": lambda: rng.randbytes(rng.choice((16, 300, 4000))),
            "long": lambda: b"global_step3" + b"x" * rng.choice((5000, 100_000, 1_000_000)),
            "empty": lambda: b"",
            "blank": lambda: b" \n\t\n",
            "missing-tag": lambda: b"global_step9",
            "dot": lambda: b".",
            "self": lambda: b"latest",
            "newline": lambda: latest.read_bytes() + b"\n",
            "non-utf8": lambda: b"global_step3\xff\xfe",
        }[op]()
        if op == "dotdot":
            _escape_target(base, root)
        latest.write_bytes(content)
        return new("latest", op, f"latest := {content[:60]!r}{'...' if len(content) > 60 else ''} "
                   f"({len(content)} bytes)", base, root,
                   touches=[Touch(rel(root, latest), "latest", 0, len(content))],
                   inconsistent=op != "newline", must_refuse=must_refuse)  # fmt: skip

    return mutate


# ---- special files -------------------------------------------------------------------------------------
def _special_target(base: Base, root: Path, rng: random.Random) -> Path:
    others = [p for p in other_files(base, root) if p.name != "config.json"]
    if others and rng.random() < 0.25:
        return rng.choice(others)
    return rng.choice(tensor_files(base, root))


SPECIAL_OPS = ("fifo", "dev-zero", "folder", "chmod-000", "dangling-symlink", "symlink-loop", "sparse-64GiB")
# What an error about a file that cannot be read as a file must not claim.
_MISLEADING = ("legacy", "truncated", "not a checkpoint zckpt recognises", "holds no")


def _special(op: str, *, the_input: bool = False) -> Mutator:
    """``the_input``: damage the CLI input itself (file or folder) rather than a file inside it."""

    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        path = root / base.input if the_input else _special_target(base, root, rng)
        no_dac = False
        if op == "fifo":
            path.unlink()
            os.mkfifo(path)
        elif op == "dev-zero":
            path.unlink()
            path.symlink_to("/dev/zero")
        elif op == "folder":
            path.unlink()
            path.mkdir()
            (path / "x").write_bytes(b"x")
        elif op == "chmod-000":
            path.chmod(0)
            no_dac = os.geteuid() == 0  # root reads anything: drop CAP_DAC_OVERRIDE for the command
        elif op == "dangling-symlink":
            path.unlink()
            path.symlink_to(path.with_name("does-not-exist"))
        elif op == "symlink-loop":
            path.unlink()
            path.symlink_to(path.name)
        elif op == "sparse-64GiB":
            os.truncate(path, 64 << 30)
        name = f"{op}-input" if the_input else op
        misleading = _MISLEADING if op in ("fifo", "dev-zero", "folder", "chmod-000") else ()
        return new("special", name, f"{op} in place of {rel(root, path)}", base, root,
                   touches=[Touch(rel(root, path), op)], inconsistent=True, no_dac_override=no_dac,
                   misleading=misleading)  # fmt: skip

    return mutate


# ---- rank files ----------------------------------------------------------------------------------------
_RANK_RE = re.compile(r"(zero_pp_rank_|^rank_)(\d+)")


def _rank_of(p: Path) -> int | None:
    m = _RANK_RE.search(p.name)
    return int(m.group(2)) if m else None


def _rank_files(base: Base, root: Path) -> list[Path]:
    return [p for p in tensor_files(base, root) if _rank_of(p) is not None]


def _pick_rank_file(base: Base, root: Path, rng: random.Random, contains: str = "") -> Path:
    files = [p for p in _rank_files(base, root) if contains in p.name]
    if not files:
        raise NotApplicable(root, f"{base.name} has no per-rank files{' ' + contains if contains else ''}")
    return rng.choice(files)


def _with_rank(p: Path, r: int) -> Path:
    return p.with_name(_RANK_RE.sub(lambda m: f"{m.group(1)}{r:0{len(m.group(2))}d}", p.name, count=1))


def _ranks_swap(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    a = _pick_rank_file(base, root, rng)
    ranks = sorted({r for p in _rank_files(base, root) if (r := _rank_of(p)) is not None} - {_rank_of(a)})
    b = _with_rank(a, rng.choice(ranks))
    tmp = a.with_name(a.name + ".swap")
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    touches = [Touch(rel(root, p), "whole file", checksummed=base.kind == "native") for p in (a, b)]
    return new("ranks", "swap", f"swap {a.name} <-> {b.name}", base, root, touches=touches,
               inconsistent=True)  # fmt: skip


def _ranks_donor(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    a = _pick_rank_file(base, root, rng)
    role = "model_states" if "model_states" in a.name else "optim_states" if "optim" in a.name else ""
    same = [p for p in sorted((root / str(base.donor) / "global_step3").iterdir())
            if _rank_of(p) == _rank_of(a) and role in p.name and p.suffix == a.suffix]  # fmt: skip
    if not same:
        raise NotApplicable(root, f"the donor has no rank-{_rank_of(a)} {role} file")
    donor = same[0]
    shutil.copy(donor, a)
    return new("ranks", "other-step-or-run", f"{a.name} replaced by the same rank's file of "
               f"{base.donor_what}", base, root,
               touches=[Touch(rel(root, a), "whole file", checksummed=base.kind == "native")],
               inconsistent=True)  # fmt: skip


def _ranks_drop(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    a = _pick_rank_file(base, root, rng)
    a.unlink()
    return new("ranks", "drop", f"delete {a.name}", base, root, touches=[Touch(rel(root, a), "deleted")],
               inconsistent=True)  # fmt: skip


def _ranks_extra(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    a = _pick_rank_file(base, root, rng)
    files = _rank_files(base, root)
    top = max(_rank_of(p) or 0 for p in files)
    b = _with_rank(a, top + 1)
    shutil.copy(a, b)
    return new("ranks", "extra-rank", f"copy {a.name} as {b.name} (one rank too many)", base, root,
               touches=[Touch(rel(root, b), "added")], inconsistent=True)  # fmt: skip


def _ranks_prefixed(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    a = _pick_rank_file(base, root, rng, "optim_states")
    b = a.with_name(("fp16_" if a.name.startswith("bf16_") else "bf16_") + a.name.removeprefix("bf16_"))
    shutil.copy(a, b)
    return new("ranks", "second-file-for-rank", f"copy {a.name} as {b.name}", base, root,
               touches=[Touch(rel(root, b), "added")], related=(a.name,), inconsistent=True)  # fmt: skip


def _ranks_alone(case_dir: Path, rng: random.Random) -> Mutation:
    base, root = fresh_copy(case_dir)
    a = rng.choice(tensor_files(base, root))
    m = new("ranks", "one-file-alone", f"input is {a.name} alone (one file of a {base.kind} checkpoint)",
            base, root, touches=[Touch(rel(root, a), "given alone")], must_refuse=True)  # fmt: skip
    m.input = rel(root, a)
    m.commands = ("consolidate", "consolidate-hf", "consolidate-bin")  # inspect/verify may describe the file
    return m


# ---- registry ------------------------------------------------------------------------------------------
FAMILIES: dict[str, list[Op]] = {
    "bytes": ops(ALL, **{op: _byte_op(op) for op in ("flip", "overwrite", "truncate", "insert", "delete")}),
    "zip": [
        Op("storage-flip", _zip_flip("storage-flip", ("zip-record",), storage=True), ZIPPED),
        Op("pickle-flip", _zip_flip("pickle-flip", ("zip-record",), storage=False), ZIPPED),
        Op("dir-name-flip", _zip_flip("dir-name-flip", ("zip-dir-name",)), ZIPPED),
        Op("local-name-flip", _zip_flip("local-name-flip", ("zip-local-name",)), ZIPPED),
        Op("crc-field-flip", _zip_field("crc-field-flip", 16, 4), ZIPPED),
        Op("size-field-flip", _zip_field("size-field-flip", 20, 8), ZIPPED),
    ],
    "latest": [
        Op(op, _latest(op, op not in ("empty", "blank", "newline")), SHARDED)
        for op in (
            "dotdot",
            "absolute",
            "nul",
            "binary",
            "long",
            "empty",
            "blank",
            "missing-tag",
            "dot",
            "self",
            "newline",
            "non-utf8",
        )
    ],  # fmt: skip
    "special": [
        *ops(ALL, **{op: _special(op) for op in SPECIAL_OPS}),
        Op("chmod-000-input", _special("chmod-000", the_input=True)),
    ],
    "ranks": [
        Op("swap", _ranks_swap, SHARDED),
        Op("other-step-or-run", _ranks_donor, SHARDED, needs_donor=True),
        Op("drop", _ranks_drop, SHARDED),
        Op("extra-rank", _ranks_extra, SHARDED),
        Op("second-file-for-rank", _ranks_prefixed, ("deepspeed",)),
        Op("one-file-alone", _ranks_alone, SHARDED),
    ],
    **structural.FAMILIES,
    **scenarios.FAMILIES,
    **dcp.FAMILIES,
    **megatron.FAMILIES,
    **side_files.FAMILIES,
}
DCP_FAMILIES = tuple(dcp.FAMILIES)
MEGATRON_FAMILIES = tuple(megatron.FAMILIES)
SIDE_FAMILIES = side_files.SIDE_FAMILIES
"""Run only when named (``--families`` / ``--megatron``), as the DCP families."""
"""Run only when named (``--families`` / ``--dcp``): the default selection, and so every earlier seed's
cases, stay as they were."""
