"""``zckpt verify CKPT``: integrity checks without a trainer; exit 0 clean, 1 problems, 2 error."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from zckpt.cli._options import (
    INPUTS,
    PICKLES,
    CkptArg,
    JsonOpt,
    ProgressOpt,
    StorageOpt,
    TagOpt,
    TrustPickleOpt,
)
from zckpt.cli._output import Output

NAME = "verify"
EPILOG = f"""Checks that every file is present and readable, no stray or stale rank files, a consistent
world size and partition sizes, intact safetensors headers and zip CRC-32s, and recomputes recorded
checksums (.crc32.json, .sha256.json and .sha256 sidecars, manifests). Prints one line per problem,
naming the file. --sha256 also prints each file's whole sha256 as sha256sum does (for `sha256sum -c`, or to
compare with a digest published elsewhere, such as the Hugging Face Hub's).

Exit status: 0 clean, 1 problems found, 2 error.

{INPUTS}

{PICKLES}
"""
EXIT_PROBLEMS = 1


def command(
    ckpt: CkptArg,
    tag: TagOpt = None,
    json: JsonOpt = False,
    trust_pickle: TrustPickleOpt = False,
    storage_option: StorageOpt = None,
    progress: ProgressOpt = True,
    sha256: Annotated[
        bool,
        typer.Option("--sha256", help="Also compute and print each file's whole sha256 (sha256sum format)."),
    ] = False,
) -> None:
    """Check a checkpoint's integrity without a trainer."""
    from zckpt.ops.verify import verify

    r = verify(ckpt, tag=tag, trust_pickle=trust_pickle, sha256=sha256, progress=progress and not json)
    out = Output(json=json)
    out.result(r.to_json())
    out.text(r.to_text())
    if not r.ok:
        raise typer.Exit(EXIT_PROBLEMS)


def needs_torch(options: dict[str, Any]) -> bool:
    """Never: headers, pickles (as placeholders) and checksums are read as bytes."""
    return False
