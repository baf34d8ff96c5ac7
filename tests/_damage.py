"""Damage done to a file after its save, as the tests inflict it: one byte's bits flipped in place."""

from __future__ import annotations

from pathlib import Path


def flip_byte(path: Path, at: int, mask: int = 0x04) -> None:
    """XOR byte ``at`` of ``path`` with ``mask``, in place (twice: the file as it was)."""
    with open(path, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ mask]))
