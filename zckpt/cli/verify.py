"""``zckpt verify CKPT``: integrity checks without a trainer; exit 0 clean, 1 problems, 2 error."""

from __future__ import annotations

import typer

from zckpt.cli._options import (
    INPUTS,
    PICKLES,
    CkptArg,
    JsonOpt,
    StorageOpt,
    TagOpt,
    TrustPickleOpt,
)
from zckpt.cli._output import Output

NAME = "verify"
EPILOG = f"""Checks that every file is present and readable, no stray or stale rank files, a consistent
world size and partition sizes, intact safetensors headers and zip CRC-32s, and recomputes recorded
checksums (.sha256 and .sha256.json sidecars, manifests). Prints one line per problem, naming the
file.

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
) -> None:
    """Check a checkpoint's integrity without a trainer."""
    from zckpt.ops.verify import verify

    r = verify(ckpt, tag=tag, trust_pickle=trust_pickle)
    out = Output(json=json)
    out.result(r.to_json())
    out.text(r.to_text())
    if not r.ok:
        raise typer.Exit(EXIT_PROBLEMS)
