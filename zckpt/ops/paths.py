"""Where outputs may go: never over, inside or around the input they are made from."""

from __future__ import annotations

from pathlib import Path

from zckpt.errors import OutputExists
from zckpt.state import CheckpointMeta


def input_root(meta: CheckpointMeta) -> Path:
    """The folder (or file) an operation must leave untouched: the save folder holding every tag of a
    checkpoint with tags, else the checkpoint's own folder or file."""
    return Path(meta.save_dir or meta.path).resolve()


def check_overlap(meta: CheckpointMeta, out: Path) -> None:
    """Refuse an output equal to the input, inside it, or containing it, before anything is written."""
    src, res = input_root(meta), out.resolve()
    if res == src or src in res.parents:
        raise OutputExists(
            f"{out}: inside the input {src}; writing there could change or delete it",
            hint="write the output somewhere else",
            path=str(out),
        )
    if res in src.parents:
        raise OutputExists(
            f"{out}: contains the input {src}; replacing it would delete the input",
            hint="write the output somewhere else",
            path=str(out),
        )
