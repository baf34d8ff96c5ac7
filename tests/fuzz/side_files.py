"""The ``side-files`` family (run when named: ``--families side-files``): the files ``consolidate`` copies
byte for byte into an HF output folder beside the weights (``config.json``, ``tokenizer.json``) made a link
to a file elsewhere on the machine (a stand-in credentials file outside the checkpoint's folder), a FIFO, a
folder, a broken link or a 64 GiB sparse file. Each must be refused naming the file, with nothing written.
Before ``zckpt.storage.copied``, the link's target was copied into the output as a plain file, the sparse
file copied for minutes, and the others made every side file be left out, exit 0. Applies to every base
``consolidate-hf`` reads; the named file is made where the base has none, and a ``tokenizer.json`` gets a
plain ``config.json`` beside it where there was none (side files are copied only from a folder holding
one)."""

from __future__ import annotations

import os
import random
from pathlib import Path

from tests.fuzz.mutation import Mutation, Mutator, Op, Touch, fresh_copy, new, rel

SECRET = b"aws_secret_access_key = fuzz-side-files\n"
OPS = (
    "config-link-out",
    "tokenizer-link-out",
    "config-fifo",
    "config-folder",
    "tokenizer-dangling",
    "tokenizer-sparse-64GiB",
)
KINDS = ("deepspeed", "native", "hf", "hf-bin", "dcp")


def _mutator(op: str) -> Mutator:
    def mutate(case_dir: Path, rng: random.Random) -> Mutation:
        base, root = fresh_copy(case_dir)
        given = root / base.input
        folder = given if given.is_dir() else given.parent
        path = folder / ("config.json" if op.startswith("config") else "tokenizer.json")
        if path.exists() or path.is_symlink():
            path.unlink()
        if path.name != "config.json" and not (folder / "config.json").exists():  # copied only beside one
            (folder / "config.json").write_text('{"model_type": "gpt2"}\n')
        if op.endswith("64GiB"):
            path.write_bytes(b"{}")
            os.truncate(path, 64 << 30)
        elif op.endswith("link-out"):
            secret = root / "elsewhere" / "credentials"
            secret.parent.mkdir()
            secret.write_bytes(SECRET)
            path.symlink_to(secret)
        elif op.endswith("fifo"):
            os.mkfifo(path)
        elif op.endswith("folder"):
            path.mkdir()
        else:
            path.symlink_to(path.with_name("does-not-exist.json"))
        return new("side-files", op, f"{op}: {rel(root, path)}", base, root,
                   touches=[Touch(rel(root, path), op)], inconsistent=True,
                   commands=("consolidate-hf",))  # fmt: skip

    return mutate


FAMILIES = {"side-files": [Op(op, _mutator(op), KINDS) for op in OPS]}
SIDE_FAMILIES = tuple(FAMILIES)
