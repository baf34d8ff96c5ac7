"""``save_16bit_model``: the model's params in the compute dtype and its persistent buffers in their own dtype
(an fp32 buffer stays fp32), in one file on rank 0, as DeepSpeed 0.19.8.

Stage 3 needs ``stage3_gather_16bit_weights_on_model_save``; without it nothing is written and False is
returned, as DeepSpeed does. With it, params are gathered ONE at a time (all ranks take part) and streamed
into a safetensors file on rank 0, so rank 0 never holds more than one full parameter. Stages 0-2 hold full
params already; rank 0 streams them. Keys are ``module.state_dict()``'s (tied aliases written as copies, so
``load_state_dict(strict=True)`` works). A ``.bin`` file name gives a ``torch.save`` state dict instead, which
must be built in rank 0's memory (DeepSpeed's format; prefer ``.safetensors`` for large models).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from zckpt.codecs.safetensors import StreamWriter
from zckpt.storage.location import local

if TYPE_CHECKING:
    from engine.engine import Engine

log = logging.getLogger(__name__)


def consolidated_state_dict(eng: Engine, *, exclude_frozen: bool = False) -> dict[str, torch.Tensor] | None:
    """``module.state_dict()``'s tensors on rank 0's host (params in the compute dtype, persistent buffers in
    their own), tied names sharing one tensor as in DeepSpeed; None on other ranks. Collective: sharded
    params are gathered one at a time and released, so no rank holds more than one full param at once
    beyond rank 0's growing host copy (DeepSpeed's ``_zero3_consolidated_16bit_state_dict``)."""
    rank0 = eng.comm.rank == 0
    state_of = {id(s.param): s for s in eng.states}
    out: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    for name, t in eng.module.state_dict(keep_vars=True).items():
        st = state_of.get(id(t))
        if st is not None and exclude_frozen and not st.trainable:
            continue
        if id(t) in first:
            if rank0:
                out[name] = out[first[id(t)]]
            continue
        first[id(t)] = name
        was = st.gathered if st is not None else True
        if st is not None and eng.fetcher is not None and not was:
            eng.fetcher.gather([st])
        if rank0:  # one host copy: .cpu() of a device tensor is already new memory, a host tensor is cloned
            v = t.detach()
            out[name] = v.cpu() if v.device.type != "cpu" else v.clone()
        if st is not None and not was:
            st.release()
    eng.comm.barrier()
    return out if rank0 else None


def save_16bit_model(eng: Engine, save_dir: str | os.PathLike[str], save_filename: str) -> bool:
    folder = local(save_dir, "save_16bit_model", hint="save to a local folder, then upload the file")
    if eng.stage == 3 and not eng.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
        log.warning(
            "Did not save the model %s because stage3_gather_16bit_weights_on_model_save is False",
            folder / save_filename,
        )
        return False
    rank0 = eng.comm.rank == 0
    path = folder / save_filename
    if rank0:
        path.parent.mkdir(parents=True, exist_ok=True)
    state_of = {id(s.param): s for s in eng.states}
    sd = eng.module.state_dict(keep_vars=True)
    specs = []
    for name, t in sd.items():
        st = state_of.get(id(t))
        shape = st.shape if st is not None else tuple(t.shape)
        specs.append((name, t.dtype, shape))
    binary = save_filename.endswith(".bin")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if rank0:
        tmp.unlink(missing_ok=True)  # left by a killed export
    writer = StreamWriter(tmp, specs, {"format": "pt"}) if rank0 and not binary else None
    kept: dict[str, torch.Tensor] = {}
    try:
        for name, t in sd.items():
            st = state_of.get(id(t))
            was = st.gathered if st is not None else True
            if st is not None and eng.fetcher is not None and not was:
                eng.fetcher.gather([st])
            if rank0:
                value = t.detach().cpu()
                if writer is not None:
                    writer.write(name, value)
                else:
                    kept[name] = value.clone()
            if st is not None and not was:
                st.release()
        if writer is not None:
            writer.commit()
        elif rank0:
            torch.save(kept, tmp)
        if rank0:
            os.replace(tmp, path)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    eng.comm.barrier()
    return True
