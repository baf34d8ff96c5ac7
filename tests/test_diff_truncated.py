"""A file shortened by another process while ``zckpt diff`` reads it: an error naming that file, never a
``SIGBUS`` that ends the process (a pipeline's, a training loop's that called ``zckpt.diff``).

diff reads every byte with ``pread`` (``zckpt.storage.fileio``); nothing is mapped. Each case runs in a child
process (a ``SIGBUS`` there is a failed test, not a dead pytest worker): two equal 12 MiB safetensors files,
and once the comparison has finished its first chunk, the child cuts B to a third of its size, as a writer
re-saving it in place (``open(..., "wb")``) would. Oracle: ``zckpt.diff`` raises ``CorruptCheckpoint`` naming
B, and the process goes on (it prints after the call). Both comparisons: numpy's (``diff_numpy``) and torch's
(``diff_values``, ``diff_numpy.usable`` patched to refuse). With the earlier mapped reads the child died of
``SIGBUS`` (exit -7) here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from zckpt.codecs.pickle_safe import StorageRef, TensorRef
from zckpt.dtypes import BY_NAME
from zckpt.errors import CorruptCheckpoint

CHILD = r"""
import os, sys
import zckpt
from zckpt.errors import CorruptCheckpoint
from zckpt.ops import diff_numpy, diff_values

a, b, mode = sys.argv[1:]
if mode == "torch":
    diff_numpy.usable = lambda *args: False
mod = diff_numpy if mode == "numpy" else diff_values
real, calls = mod._bits_equal, []

def cut_after_first(*args):
    calls.append(1)
    if len(calls) == 2:  # the first chunk pair is compared; B is shortened under the reader
        os.truncate(b, os.path.getsize(b) // 3)
    return real(*args)

mod._bits_equal = cut_after_first
try:
    zckpt.diff(a, b, progress=False)
except CorruptCheckpoint as e:
    print("REFUSED", e.path, "|", e, flush=True)
    sys.exit(0)
print("NO ERROR after", len(calls), "chunks", flush=True)
sys.exit(1)
"""


@pytest.mark.parametrize("mode", ["numpy", "torch"])
def test_diff_of_a_file_shortened_mid_read_is_an_error(mode: str, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(3 << 20, generator=g)}  # 12 MiB: 3 chunks of 1 Mi elements
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(sd, str(a))
    save_file(sd, str(b))
    r = subprocess.run([sys.executable, "-c", CHILD, str(a), str(b), mode], capture_output=True, text=True,
                       timeout=120, check=False)  # fmt: skip
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.startswith(f"REFUSED {b} |"), r.stdout
    assert "changed?" in r.stdout or "truncated" in r.stdout, r.stdout
    assert b.stat().st_size < a.stat().st_size  # the cut did happen mid-read


def test_a_pickled_tensor_reads_only_its_view_and_refuses_one_outside_its_storage(tmp_path: Path) -> None:
    """``TensorRef.load`` (a .pt pickle's tensor, read with ``pread``): a strided view of a storage reads the
    elements it reaches (oracle: the same ``as_strided`` on the storage's values), and a view that reaches
    past its storage is a ``CorruptCheckpoint``, not a torch error or bytes of the next record."""
    f32 = BY_NAME["float32"]
    values = torch.arange(40, dtype=torch.float32)
    f = tmp_path / "storage.bin"
    f.write_bytes(b"\0" * 8 + values.numpy().tobytes())
    st = StorageRef("0", f32, 40)
    ref = TensorRef(st, 5, (3, 4), (8, 1))
    ref.file, ref.byte_offset = str(f), 8 + 5 * 4
    assert torch.equal(ref.load(), torch.as_strided(values, (3, 4), (8, 1), 5))
    bad = TensorRef(st, 30, (3, 4), (8, 1))  # reaches element 30 + 16 + 3 = 49 of 40
    bad.file, bad.byte_offset = str(f), 8 + 30 * 4
    with pytest.raises(CorruptCheckpoint, match="outside its storage"):
        bad.load()
