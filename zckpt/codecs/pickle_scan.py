"""The walk over a pickle's opcodes that bounds it before the C unpickler runs (``zckpt.codecs.pickle_safe``).

It builds nothing. Every length prefix must fit the data (the C unpickler allocates a lying length before it
finds the data short), memo indices must be the sequential ones a pickler writes (a ``LONG_BINPUT`` of 2**31
makes it allocate and zero a 16 GiB memo), and the stack, marks included, must stay under ``max_stack``.

One table entry per opcode, built from ``pickletools.opcodes`` (the stack effects are its own), and one tight
loop: a DCP ``.metadata`` holds over a million opcodes, which ``pickletools.genops`` walked in ~2 s.
"""

from __future__ import annotations

import pickletools

from zckpt.errors import CorruptCheckpoint, UnsafePickle

# how an opcode's argument is laid out
_NONE, _FIXED, _LEN1, _LEN4, _LEN4S, _LEN8, _LINE, _LINES2 = range(8)
# what it does to the memo (by an index in its argument, or MEMOIZE's next slot), or STOP
_PUT, _GET, _PUT_LINE, _GET_LINE, _MEMOIZE, _STOP = range(8, 14)

_ARG_KIND = {
    pickletools.UP_TO_NEWLINE: _LINE,
    pickletools.TAKEN_FROM_ARGUMENT1: _LEN1,
    pickletools.TAKEN_FROM_ARGUMENT4: _LEN4S,
    pickletools.TAKEN_FROM_ARGUMENT4U: _LEN4,
    pickletools.TAKEN_FROM_ARGUMENT8U: _LEN8,
}


def _entry(op: pickletools.OpcodeInfo) -> tuple[int, int, int, int, int]:
    """(kind, fixed argument bytes, items popped, items pushed, marks: 1 pops one, 2 pushes one, 3 both)."""
    before, after = op.stack_before, op.stack_after
    special = (pickletools.markobject, pickletools.stackslice)
    pop = len([x for x in before if x not in special])
    push = len([x for x in after if x is not pickletools.markobject])
    marks = (pickletools.markobject in before) | (pickletools.markobject in after) << 1
    n = op.arg.n if op.arg is not None else 0
    kind = _NONE if op.arg is None else _FIXED if n >= 0 else _ARG_KIND[n]
    if op.name in ("GLOBAL", "INST"):
        kind = _LINES2
    kind = {
        "BINPUT": _PUT, "LONG_BINPUT": _PUT, "BINGET": _GET, "LONG_BINGET": _GET, "PUT": _PUT_LINE,
        "GET": _GET_LINE, "MEMOIZE": _MEMOIZE, "STOP": _STOP,
    }.get(op.name, kind)  # fmt: skip
    if kind == _NONE:
        kind = _FIXED  # no argument: 0 fixed bytes
    return kind, max(n, 0), pop, push, marks


_TABLE: list[tuple[int, int, int, int, int] | None] = [None] * 256
for _op in pickletools.opcodes:
    _TABLE[ord(_op.code)] = _entry(_op)
# ``prescan`` applies these stack effects inline: a GET pushes one item, a PUT changes nothing, neither marks
assert all(t[2:] == (0, 1, 0) for t in _TABLE if t is not None and t[0] == _GET)
assert all(t[2:] == (0, 0, 0) for t in _TABLE if t is not None and t[0] == _PUT)


def prescan(data: bytes, source: str, max_stack: int) -> None:
    """Walk ``data``'s opcodes up to STOP (see the module doc); a damaged pickle raises ``CorruptCheckpoint``,
    a hostile one ``UnsafePickle``. The stack is tracked as ``depth`` items above the last mark, ``marks``
    of them below (the walk clamps an underflow at 0, as the reference walk does)."""
    table, size, from_bytes = _TABLE, len(data), int.from_bytes
    i = memo = depth = nmarks = 0
    marks: list[int] = []
    while True:
        if i >= size:
            raise _corrupt(source, "pickle exhausted before seeing STOP")
        t = table[data[i]]
        if t is None:
            raise _corrupt(source, f"at position {i}, opcode {data[i]:#04x} unknown")
        kind, n, pop, push, mark = t
        i += 1
        if kind == _FIXED:
            if n:
                i += n
                if i > size:
                    raise _past_end(source, i, size)
        elif kind == _GET:
            idx = from_bytes(data[i : i + n], "little")
            i += n
            if i > size:
                raise _past_end(source, i, size)
            if idx >= memo:
                raise UnsafePickle(f"{source}: pickle reads memo slot {idx} before writing it", path=source)
            depth += 1  # a GET pushes one item (no mark, pops nothing)
            if depth + nmarks > max_stack:
                raise UnsafePickle(f"{source}: pickle nests deeper than {max_stack} levels", path=source)
            continue
        elif kind == _PUT:
            idx = from_bytes(data[i : i + n], "little")
            i += n
            if i > size:
                raise _past_end(source, i, size)
            if idx >= memo:
                if idx > memo:
                    raise UnsafePickle(f"{source}: pickle memo index {idx} out of sequence", path=source)
                memo += 1
            continue  # a PUT leaves the stack as it is
        elif kind == _MEMOIZE:
            memo += 1
        else:
            i, memo = _variable(data, i, kind, memo, source)
            if kind == _STOP:
                return
        if mark:
            if mark & 1:
                if not marks:
                    raise UnsafePickle(f"{source}: pickle pops a mark it never pushed", path=source)
                depth = marks.pop()
                nmarks -= 1
            depth = depth - pop if depth > pop else 0
            depth += push
            if mark & 2:
                marks.append(depth)
                nmarks += 1
        elif depth >= pop:
            if push == pop:  # most opcodes (PUT/GET aside, ~half of a DCP .metadata) leave the depth as is
                continue
            depth += push - pop
        else:
            depth = push
        if depth + nmarks > max_stack:
            raise UnsafePickle(f"{source}: pickle nests deeper than {max_stack} levels", path=source)


def _variable(data: bytes, i: int, kind: int, memo: int, source: str) -> tuple[int, int]:
    """(position after, memo count after) an opcode whose argument is sized by its own bytes (a length
    prefix, or a newline), or STOP."""
    size = len(data)
    if kind == _LEN1:
        i += 1 + (data[i] if i < size else 0)
    elif kind == _LEN4 or kind == _LEN4S:  # noqa: SIM109 - int compares beat a tuple built per opcode
        i += 4 + int.from_bytes(data[i : i + 4], "little", signed=kind == _LEN4S)
        if i < 0:
            raise _corrupt(source, "negative length prefix")
    elif kind == _LEN8:
        i += 8 + int.from_bytes(data[i : i + 8], "little")
    elif kind == _LINE or kind == _PUT_LINE or kind == _GET_LINE:  # noqa: SIM109
        end = data.find(b"\n", i)
        if end < 0:
            raise _corrupt(source, "no newline found when trying to read stringnl")
        if kind != _LINE:
            try:
                idx = int(data[i:end])
            except ValueError:
                raise _corrupt(source, "memo index is not a number") from None
            if kind == _PUT_LINE and idx > memo or kind == _GET_LINE and idx >= memo:
                raise UnsafePickle(f"{source}: pickle memo index {idx} out of sequence", path=source)
            memo += kind == _PUT_LINE and idx == memo
        i = end + 1
    elif kind == _LINES2:
        end = data.find(b"\n", data.find(b"\n", i) + 1)
        if end < 0 or data.find(b"\n", i) < 0:
            raise _corrupt(source, "no newline found when trying to read stringnl")
        i = end + 1
    if i > size:
        raise _past_end(source, i, size)
    return i, memo


def _past_end(source: str, i: int, size: int) -> CorruptCheckpoint:
    return _corrupt(source, f"an argument runs past the end of the data ({i} > {size} bytes)")


def _corrupt(source: str, why: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"{source}: unreadable pickle ({why[:120]})", path=source)


__all__ = ["prescan"]
