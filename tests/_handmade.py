"""Hand-made checkpoints for diff/verify/stats tests: raw rank files written here, byte by byte,
and a ``Checkpoint`` built directly from ``Piece``/``TensorEntry`` over them (an oracle independent
of every format reader).

Each tensor is split ZeRO-3 style over ``world`` rank files (chunk = ceil(n/world)); every chunk is
followed by ``pad`` garbage elements (NaN for floats, 0x7F.. for ints) that no reader may touch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zckpt.checkpoint import Checkpoint
from zckpt.model import Piece, Role, TensorEntry
from zckpt.state import CheckpointMeta


def make_ckpt(
    root: Path,
    tensors: dict[str, torch.Tensor],
    *,
    world: int = 2,
    pad: int = 3,
    optim: dict[str, torch.Tensor] | None = None,
    tied: dict[str, str] | None = None,
    fmt: str = "handmade",
) -> Checkpoint:
    root.mkdir(parents=True, exist_ok=True)
    files = [root / f"rank{r}.bin" for r in range(world)]
    blobs = [bytearray() for _ in range(world)]
    entries: list[TensorEntry] = []
    items = [(k, t, None) for k, t in tensors.items()]
    items += [(k.split(":")[0], t, k.split(":")[1]) for k, t in (optim or {}).items()]
    for name, t, state in items:
        flat = t.detach().reshape(-1).contiguous()
        n = flat.numel()
        c = -(-n // world) if n else 0
        pieces = []
        for r in range(world):
            lo, hi = min(r * c, n), min((r + 1) * c, n)
            blob = blobs[r]
            blob.extend(b"\0" * (-len(blob) % 8))
            off = len(blob)
            blob.extend(flat[lo:hi].numpy().tobytes() if flat.dtype != torch.bfloat16 else
                        flat[lo:hi].view(torch.int16).numpy().tobytes())  # fmt: skip
            garbage = torch.full((pad,), float("nan")) if t.is_floating_point() else torch.full((pad,), 127)
            g = garbage.to(t.dtype)
            blob.extend(
                g.view(torch.int16).numpy().tobytes() if g.dtype == torch.bfloat16 else g.numpy().tobytes()
            )
            if hi > lo:
                pieces.append(Piece(str(files[r]), off, t.dtype, lo, hi - lo, rank=r, padding=pad))
        role = Role.OPTIM if state else (Role.BUFFER if not t.is_floating_point() else Role.PARAM)
        entries.append(TensorEntry(name, tuple(t.shape), t.dtype, role, tuple(pieces), state=state))
    for f, b in zip(files, blobs, strict=True):
        f.write_bytes(bytes(b))
    meta = CheckpointMeta(
        format=fmt, path=str(root), world_size=world, tied=dict(tied or {}), files=tuple(map(str, files))
    )
    return Checkpoint(meta, entries)
