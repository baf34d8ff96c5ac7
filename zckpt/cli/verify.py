"""``zckpt verify CKPT``: integrity checks without a trainer; exit 0 clean, 1 problems, 2 error."""

from __future__ import annotations

import typer

from zckpt.cli._options import CkptArg, JsonOpt, StorageOpt, TagOpt, TrustPickleOpt, use_storage_options
from zckpt.cli._output import Output

NAME = "verify"
EXIT_PROBLEMS = 1


def command(
    ckpt: CkptArg,
    tag: TagOpt = None,
    json: JsonOpt = False,
    trust_pickle: TrustPickleOpt = False,
    storage_option: StorageOpt = None,
) -> None:
    """Check a checkpoint's integrity without a trainer; exit 0 only when clean.

    Every file present and readable, no stray or stale rank files, consistent world size and
    partition sizes, safetensors headers and zip CRC-32s intact, recorded checksums (.sha256
    sidecars, manifests) recomputed. One line per problem, naming the file.
    """
    use_storage_options(storage_option)
    from zckpt.ops.verify import verify

    r = verify(ckpt, tag=tag, trust_pickle=trust_pickle)
    out = Output(json=json)
    out.result(r.to_json())
    out.text(r.to_text())
    if not r.ok:
        raise typer.Exit(EXIT_PROBLEMS)
