"""Every call into ``torch.distributed`` the engine makes after start-up, bucketed.

``Comm`` is the data-parallel group seen by the engine. World size 1 (no process group) is a normal case:
each collective degenerates to a local copy, so the same code paths run single-process.

The two hot collectives work on *buckets* of several parameters so that one launch moves many tensors:

- ``all_gather_params``: the shards of several params are concatenated into one input buffer, all-gathered
  into one ``(world, total)`` output, and each param's full tensor is cut out of it;
- ``reduce_grads``: the full gradients of several params are laid out rank-major in one ``(world, total)``
  buffer (each rank's chunk of every param side by side), reduce-scattered (or all-reduced when the
  partition world is 1, i.e. stage 0) and averaged over the ranks.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from engine.dist import settle_at_exit
from engine.zero.shm import ShmPeers
from engine.zero.shm import usable as shm_usable

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """The data-parallel process group (the default group), or a single process without one."""

    def __init__(self) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if self.active else 1
        self.rank = dist.get_rank() if self.active else 0
        self._scratch: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self.pairwise = self.active and dist.get_backend() == "gloo"
        if self.pairwise:
            settle_at_exit()  # the script's own init_process_group("gloo") too
        """Build all-gather and reduce-scatter from one ``all_to_all_single`` (a pairwise exchange): gloo's
        own ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` are several times slower for bucket-sized
        tensors (bench/RESULTS.md); NCCL's are optimal."""
        self._shm: ShmPeers | None | bool = None if self.pairwise and self.world > 1 else False
        self.shm_min_bytes = int(os.environ.get("ZCKPT_ENGINE_SHM_MIN_BYTES", 1 << 16))
        """Smaller exchanges stay on gloo: below this a segment's barrier costs as much as the socket."""

    def shm(self, nbytes: int) -> ShmPeers | None:
        """The shared-memory peers (``engine.zero.shm``) for an exchange of ``nbytes`` per rank, when every
        rank is on this host; set up by the first large collective (a collective call itself)."""
        if self._shm is False or nbytes < self.shm_min_bytes:
            return None
        if self._shm is None:
            self._shm = ShmPeers(self.world, self.rank) if shm_usable(self.world) else False
        return self._shm if isinstance(self._shm, ShmPeers) else None

    def scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reusable buffer of ``numel`` elements. The all-gather uses slots ``"x"``, ``"y"``, ``"z"``, whose
        data dies before it returns; the gradient reduction uses ``"rx"``, ``"ry"``, ``"rz"``, alive while it
        is in flight and (``"rz"``, its result) until the caller has added it into the grad shards, before it
        starts the next one.

        On the host every fresh bucket-sized tensor is a new ``mmap`` (glibc serves large allocations that
        way) whose pages fault in one by one as the collective writes them and are unmapped when it is
        freed: per step that is as many page faults as bytes moved. Reusing one buffer per (use, dtype)
        removes them. Accelerators have a caching allocator already, so this is host-only.
        """
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        key = (name, dtype, device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # -- small, generic ---------------------------------------------------------------------------
    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.distributed:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op])
        return t

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.distributed:
            dist.broadcast(t, src)
        return t

    def broadcast_flat_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Broadcast several tensors of one dtype in one launch (flatten, broadcast, copy back)."""
        if not self.distributed or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.broadcast(flat, src)
        off = 0
        for t in tensors:
            t.copy_(flat[off : off + t.numel()].view_as(t))
            off += t.numel()

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    # -- bucketed param / grad collectives --------------------------------------------------------
    def all_gather_params(self, shards: Sequence[torch.Tensor], numels: Sequence[int]) -> list[torch.Tensor]:
        """Full flat tensors (``numels[i]`` elements each) from every rank's ``shards[i]`` in ONE collective.

        All shards share a dtype and device; ``shards[i]`` has the per-rank chunk length of param ``i``.
        """
        if not shards:
            return []
        w = self.world
        if w == 1:
            return [s[:n].clone() for s, n in zip(shards, numels, strict=True)]
        sizes = [s.numel() for s in shards]
        total = sum(sizes)
        dtype, device = shards[0].dtype, shards[0].device
        peers = self.shm(total * shards[0].element_size()) if device.type == "cpu" else None
        if peers is not None:
            return self._all_gather_shm(peers, shards, sizes, numels)
        inp = _adjacent(shards)
        if inp is None:
            flat = [s.reshape(-1) for s in shards]
            inp = torch.cat(flat, out=self.scratch("x", total, dtype, device))
        # a lone param's full tensor is a view of a fresh output (no copy); the params of a bucket are
        # copied out of a scratch output into tensors of their own
        lone = sum(1 for c in sizes if c) <= 1
        out = (
            torch.empty(w * total, dtype=dtype, device=device)
            if lone
            else self.scratch("z", w * total, dtype, device)
        )
        self._all_gather(out, inp)
        rows = out.view(w, total)
        fulls: list[torch.Tensor] = []
        off = 0
        for c, n in zip(sizes, numels, strict=True):
            if lone:
                full = rows[:, off : off + c].reshape(-1)
            else:
                full = torch.empty(w * c, dtype=dtype, device=device)
                full.view(w, c).copy_(rows[:, off : off + c])
            fulls.append(full[:n])
            off += c
        return fulls

    def _all_gather_shm(
        self, peers: ShmPeers, shards: Sequence[torch.Tensor], sizes: Sequence[int], numels: Sequence[int]
    ) -> list[torch.Tensor]:
        """``all_gather_params`` through shared memory: my shards into my segment, a barrier, then each full
        tensor assembled straight from every rank's segment (the one copy the gather needs)."""
        dtype = shards[0].dtype
        total = sum(sizes)
        rows = [seg.view(dtype) for seg in peers.next("gather", total * shards[0].element_size())]
        torch.cat([sh.reshape(-1) for sh in shards], out=rows[self.rank])  # one copy, adjacent or not
        peers.barrier()
        fulls: list[torch.Tensor] = []
        off = 0
        for c, n in zip(sizes, numels, strict=True):
            full = torch.cat([row[off : off + c] for row in rows])
            fulls.append(full[:n])
            off += c
        return fulls

    def reduce_grads(
        self, grads: Sequence[torch.Tensor], chunks: Sequence[int], partition_world: int
    ) -> torch.Tensor:
        """Average full gradients over the ranks in ONE collective; return this rank's chunks, concatenated
        (``chunks[0]`` elements of grad 0, then ``chunks[1]`` of grad 1...).

        ``partition_world`` is ``world`` (reduce-scatter: rank r gets elements ``[r*c, r*c+c)`` of each) or 1
        (all-reduce: every rank gets the whole gradient; stage 0).
        """
        return self.start_reduce_grads(grads, chunks, partition_world).wait()

    def start_reduce_grads(
        self,
        grads: Sequence[torch.Tensor],
        chunks: Sequence[int],
        partition_world: int,
        dtype: torch.dtype | None = None,
    ) -> Reduction:
        """``reduce_grads`` launched asynchronously: the gradients are laid out (so they may be freed when
        this returns) and the collective runs in the background -- on gloo's worker thread, or NCCL's
        stream -- while the caller goes on with the backward. ``wait()`` on the result gives what
        ``reduce_grads`` returns. Its buffers are the ``"r*"`` scratch slots, distinct from the
        all-gather's, so params can be gathered meanwhile; at most one reduction may be in flight. ``dtype``:
        the dtype the gradients are reduced in (``communication_data_type``; default: theirs)."""
        pw = partition_world
        total = sum(chunks)
        dtype, device = dtype or grads[0].dtype, grads[0].device
        nbytes = pw * total * dtype.itemsize
        peers = self.shm(nbytes) if device.type == "cpu" else None
        segs = (
            None
            if peers is None
            else [seg.view(dtype).view(pw, total) for seg in peers.next("reduce", nbytes)]
        )
        buf = (
            self.scratch("rx", pw * total, dtype, device).view(pw, total) if segs is None else segs[self.rank]
        )
        off = 0
        for g, c in zip(grads, chunks, strict=True):
            # lay the gradient out rank-major without a padded temporary: full rows, a partial row, zeros
            if c == 0:
                continue
            flat = g.reshape(-1)
            n = flat.numel()
            rows, rem = divmod(n, c)
            if rows:
                buf[:rows, off : off + c].copy_(flat[: rows * c].view(rows, c))
            if rows < pw:
                buf[rows, off : off + rem].copy_(flat[rows * c :])
                buf[rows, off + rem : off + c].zero_()
                buf[rows + 1 :, off : off + c].zero_()
            off += c
        if self.world == 1:
            return Reduction(None, buf.view(-1), 1)
        if pw != 1 and pw != self.world:
            raise ValueError(f"partition world {pw} must be 1 or the world size {self.world}")
        if segs is not None:
            assert peers is not None
            # every rank reads the part meant for it (its row; stage 0: everything) from every segment
            parts = [seg.view(-1) if pw == 1 else seg[self.rank] for seg in segs]
            out = self.scratch("rz", parts[0].numel(), dtype, device)
            return Reduction(peers.start_barrier(), out, self.world, parts=parts)
        if pw == 1:
            return Reduction(dist.all_reduce(buf, async_op=True), buf.view(-1), self.world)
        mine = self.scratch("rz", total, dtype, device)
        if not self.pairwise:
            return Reduction(_reduce_scatter(mine, buf.view(-1), async_op=True), mine, self.world, keep=buf)
        got = self.scratch("ry", buf.numel(), dtype, device)
        work = dist.all_to_all_single(got, buf.view(-1), async_op=True)  # row j of rank i -> rank j, row i
        return Reduction(work, mine, self.world, parts=list(got.view(self.world, -1).unbind(0)))

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if not self.pairwise:
            _all_gather(out, inp)
            return
        rep = self.scratch("y", out.numel(), inp.dtype, inp.device).view(self.world, -1)
        rep.copy_(inp.reshape(1, -1).expand_as(rep))  # rank j's row goes to rank j: every row is my shard
        dist.all_to_all_single(out, rep)


class Reduction:
    """An in-flight ``Comm.start_reduce_grads``; ``wait()`` returns this rank's averaged chunks."""

    def __init__(
        self,
        work: Any,
        out: torch.Tensor,
        world: int,
        *,
        parts: list[torch.Tensor] | None = None,
        keep: torch.Tensor | None = None,
    ) -> None:
        self._work = work
        self._out = out
        self._world = world
        self._parts = parts
        """The ranks' contributions to my result, summed into ``out`` at ``wait`` (the pairwise exchange's
        received rows, or the shared-memory segments' parts meant for me)."""
        self._keep = keep  # the input, alive until the collective is done (an accelerator's fresh buffer)

    def wait(self) -> torch.Tensor:
        """Block until the collective is done; the averaged result (the same tensor on a second call)."""
        if self._world > 1:
            if self._work is not None:
                self._work.wait()
            if self._parts is not None:
                # a chain of adds: one pass per rank, faster than a reduction over a stacked dim
                torch.add(self._parts[0], self._parts[1], out=self._out)
                for part in self._parts[2:]:
                    self._out.add_(part)
            self._out.div_(self._world)
            self._work = self._parts = self._keep = None
            self._world = 1
        return self._out


def _adjacent(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over ``tensors`` when they lie back to back in one storage (the shards of consecutive
    params in the engine's flat shard buffer), so a bucket is all-gathered without concatenating it."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != end or t.untyped_storage().data_ptr() != storage:
            return None
        end += t.numel() * t.element_size()
    return first.as_strided((sum(t.numel() for t in tensors),), (1,))
