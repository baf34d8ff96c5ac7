"""engine.zero.collectives on 3 gloo ranks: the pairwise (all_to_all) all-gather and reduce-scatter used on
gloo against gloo's own collectives and against hand-made tensors, on awkward sizes, with scratch reuse and a
reduction in flight while params are gathered, and bf16 gradients reduced in fp32
(``communication_data_type``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run

from engine.zero.collectives import Comm

pytestmark = pytest.mark.dist


def _shard(rank: int, c: int, salt: int) -> torch.Tensor:
    return torch.arange(c, dtype=torch.float32) + 1000 * rank + 100_000 * salt


def _check(rank: int, world: int) -> dict[str, Any]:
    comm = Comm()
    assert comm.pairwise  # gloo
    out: dict[str, Any] = {}
    for mode in ("shm", "pairwise", "gloo"):
        pairwise = mode
        comm.pairwise = mode != "gloo"
        comm.shm_min_bytes = 0 if mode == "shm" else 1 << 62
        for numels in ([7, 1, 0, 10], [30], [5, 3], [2, 0], [3000, 9]):  # several, lone, smaller, an empty
            chunks = [-(-n // world) for n in numels]
            shards = [_shard(rank, c, i) for i, c in enumerate(chunks)]
            if len(numels) == 2:  # adjacent views of one flat buffer (the engine's shard buffer)
                flat = torch.cat(shards)
                shards = list(flat.split(chunks))
            fulls = comm.all_gather_params(shards, numels)
            kept = [f.clone() for f in fulls]
            comm.all_gather_params([_shard(rank, c, 9) for c in chunks], numels)  # reuses the scratch
            for i, (f, k, n, c) in enumerate(zip(fulls, kept, numels, chunks, strict=True)):
                want = torch.cat([_shard(r, c, i) for r in range(world)])[:n]
                assert torch.equal(f, want) and torch.equal(f, k), (pairwise, numels, i, f, want, k)
        assert (comm.shm(1 << 20) is not None) == (mode == "shm")  # the shm mode really ran on /dev/shm
        g = torch.Generator().manual_seed(0)
        sizes = (13, 4, 1, 9, 4000)
        every = [[torch.randn(n, generator=g) for n in sizes] for _ in range(world)]
        ints = [[torch.randint(-50, 50, (n,), generator=g).float() for n in sizes] for _ in range(world)]
        for grads_of in (every, ints):
            chunks = [-(-t.numel() // world) for t in grads_of[0]]
            mine = comm.reduce_grads(grads_of[rank], chunks, world).clone()
            comm.reduce_grads(grads_of[(rank + 1) % world], chunks, world)  # reuses the scratch
            want = []
            for i, c in enumerate(chunks):
                full = torch.stack([gr[i] for gr in grads_of]).sum(0) / world
                padded = torch.cat([full, torch.zeros(c * world - full.numel())])
                want.append(padded[rank * c : rank * c + c])
            w = torch.cat(want)
            exact = grads_of is ints
            assert torch.equal(mine, w) if exact else torch.allclose(mine, w, atol=1e-6), (pairwise, exact)
            # asynchronous: the inputs are dropped and params gathered while the reduction is in flight
            grads = [t.clone() for t in grads_of[rank]]
            pending = comm.start_reduce_grads(grads, chunks, world)
            del grads
            gathered = comm.all_gather_params([_shard(rank, 4, 7)], [4 * world - 1])
            assert torch.equal(gathered[0], torch.cat([_shard(r, 4, 7) for r in range(world)])[:-1])
            assert torch.equal(pending.wait(), w) if exact else torch.allclose(pending.wait(), w, atol=1e-6)
            whole = comm.reduce_grads(grads_of[rank], [t.numel() for t in grads_of[rank]], 1)  # stage 0
            summed = [torch.stack([gr[i] for gr in grads_of]).sum(0) for i in range(len(sizes))]
            assert torch.allclose(whole, torch.cat(summed) / world, atol=1e-6), mode
        # communication_data_type: bf16 gradients reduced in fp32 keep what a bf16 sum rounds away
        # (1 + 2^-9 is 1 in bf16); the result comes back in fp32
        small = [torch.full((n,), 1.0 if rank == 0 else 2.0**-9, dtype=torch.bfloat16) for n in (5, 8)]
        for pw in (world, 1):
            chunks = [-(-t.numel() // pw) for t in small]
            want_sum = torch.tensor(1.0 + (world - 1) * 2.0**-9, dtype=torch.float32) / world
            wide = comm.start_reduce_grads(small, chunks, pw, torch.float32).wait()
            real = wide[wide != 0]  # stage 0: every element; stages 1-3: my chunks, padding zeros dropped
            assert wide.dtype == torch.float32 and real.numel() > 0, (mode, pw)
            assert torch.all(real == want_sum), (mode, pw)
            narrow = comm.start_reduce_grads(small, chunks, pw).wait()
            assert narrow.dtype == torch.bfloat16 and not torch.any(narrow.float() == want_sum), (mode, pw)
        out[mode] = True
    return out


def test_pairwise_collectives_match_gloo_and_hand_made() -> None:
    assert run(_check, 3) == [{"shm": True, "pairwise": True, "gloo": True}] * 3
    assert not list(Path("/dev/shm").glob("zckpt-engine-*"))  # every segment was unlinked once mapped
