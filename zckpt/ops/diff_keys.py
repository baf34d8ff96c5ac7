"""Which keys of two checkpoints ``zckpt diff`` pairs, and which stay one-sided: ``map`` renames of A's
keys, ``keys`` globs, optimizer states, tied aliases matched via their owner (see ``zckpt.ops.diff``).

Selecting options must select something (``zckpt.ops.select``): a ``keys`` glob matching no key of either
side, a ``map`` entry renaming no key of A, and ``include_optimizer`` when neither side holds optimizer
states are ``KeyMappingError`` s (exit 2), never an empty comparison that reads as equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zckpt.checkpoint import Checkpoint
from zckpt.errors import KeyMappingError
from zckpt.ops.diff_report import Pair
from zckpt.ops.select import glob_matches, require_globs


@dataclass(frozen=True)
class Matching:
    """The pairs to compare (each (owner in A, owner in B) once) and the keys left on one side."""

    pairs: tuple[Pair, ...]
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    aliases: tuple[tuple[str, str, str], ...]
    """``(side, alias, owner)`` of each alias matched via its owner."""
    tied_skipped: int
    with_optim: bool
    notes: tuple[str, ...]


def match_keys(
    ca: Checkpoint,
    cb: Checkpoint,
    globs: Sequence[str] | None,
    maps: tuple[tuple[str, str], ...],
    include_optimizer: bool,
) -> Matching:
    """Pair A's keys (renamed by ``maps``) with B's, restricted to ``globs``. A tied alias of one side that
    the other side lacks is paired with the owner the other side holds (then usually a repeat of the owners'
    own pair, skipped and counted in ``tied_skipped``)."""
    with_optim = _with_optim(ca, cb, include_optimizer)
    b_all = _keys(cb, with_optim)
    a_of = _mapped(_keys(ca, with_optim), maps, b_all)  # key in B's namespace -> A's key
    require_globs("--keys", globs or (), [*a_of, *b_all], "A or B")
    b_keys = [k for k in b_all if _selected(k, globs)]
    b_set = set(b_all)
    pairs: list[Pair] = []
    seen: set[tuple[str, str]] = set()
    skipped = 0

    def add(ka: str, kb: str) -> None:
        nonlocal skipped
        ea, eb = ca.entry(ka), cb.entry(kb)
        if (ea.key, eb.key) in seen:
            skipped += 1
            return
        seen.add((ea.key, eb.key))
        pairs.append((ka, kb, ea, eb))

    for kb in b_keys:
        if kb in a_of:
            add(a_of[kb], kb)
    tied_a = {rename(al, maps): rename(ow, maps) for al, ow in ca.meta.tied.items()}
    aliases: list[tuple[str, str, str]] = []
    only_a: list[str] = []
    for m, ka in a_of.items():
        if m in b_set or not _selected(m, globs):
            continue
        if tied_a.get(m) in b_set:
            aliases.append(("A", ka, ca.meta.tied[ka]))
            add(ka, tied_a[m])
        else:
            only_a.append(ka)
    only_b: list[str] = []
    for kb in b_keys:
        if kb in a_of:
            continue
        owner = cb.meta.tied.get(kb)
        if owner is not None and owner in a_of:
            aliases.append(("B", kb, owner))
            add(a_of[owner], kb)
        else:
            only_b.append(kb)
    notes = _optim_note(ca, cb, include_optimizer)
    return Matching(tuple(pairs), tuple(only_a), tuple(only_b), tuple(aliases), skipped, with_optim, notes)


def rename(key: str, maps: tuple[tuple[str, str], ...]) -> str:
    for old, new in maps:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def _selected(key: str, globs: Sequence[str] | None) -> bool:
    return not globs or any(glob_matches(key, g) for g in globs)


def _keys(c: Checkpoint, with_optim: bool) -> list[str]:
    return list(c) + (c.optim_keys() if with_optim else [])


def _with_optim(ca: Checkpoint, cb: Checkpoint, include_optimizer: bool) -> bool:
    """Whether optimizer states are compared: asked for and held by both sides. Asked for when neither
    side holds any selects nothing: an error (``zckpt.ops.select``)."""
    if not include_optimizer:
        return False
    if not ca.optim_keys() and not cb.optim_keys():
        raise KeyMappingError(
            f"--include-optimizer: neither A ({ca.meta.path}) nor B ({cb.meta.path}) holds optimizer states",
            hint="drop --include-optimizer to compare the model tensors",
        )
    return bool(ca.optim_keys()) and bool(cb.optim_keys())


def _optim_note(ca: Checkpoint, cb: Checkpoint, include_optimizer: bool) -> tuple[str, ...]:
    if not include_optimizer or (bool(ca.optim_keys()) == bool(cb.optim_keys())):
        return ()
    has, lacks = ("A", "B") if ca.optim_keys() else ("B", "A")
    return (f"only {has} holds optimizer states ({lacks} none): optimizer states not compared",)


def _mapped(keys: list[str], maps: tuple[tuple[str, str], ...], b_keys: list[str]) -> dict[str, str]:
    """A's keys by their name in B's namespace. Every ``map`` entry must rename some key (else it is a
    typo or goes the wrong way: an error naming it), and no two keys may land on one name."""
    a_of: dict[str, str] = {}
    used: set[int] = set()
    for k in keys:
        m = k
        for i, (old, new) in enumerate(maps):
            if k.startswith(old):
                m = new + k[len(old) :]
                used.add(i)
                break
        if m in a_of:
            raise KeyMappingError(
                f"--map sends both {a_of[m]!r} and {k!r} to {m!r}", hint="use more specific OLD prefixes"
            )
        a_of[m] = k
    for i, (old, new) in enumerate(maps):
        if i in used:
            continue
        if any(k.startswith(old) for k in keys):
            what = f"renames no key of A: an earlier --map renames every key starting with {old!r}"
        else:
            what = f"no key of A starts with {old!r}"
        hint = "check the prefix (plain text, case-sensitive); `zckpt inspect` lists the names"
        if any(k.startswith(old) for k in b_keys):
            hint = (
                f"--map renames A's keys into B's names (OLD=NEW), and B's keys start with {old!r}: "
                f"--map {new}={old}?"
            )
        raise KeyMappingError(f"--map {old}={new}: {what}", hint=hint)
    return a_of
