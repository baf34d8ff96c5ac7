"""zckpt.storage.direct_io through ``HashingSink``: the file's bytes and sha256 equal what was written
(oracle: the concatenated input and hashlib) for awkward write sizes around the block and buffer sizes, with
O_DIRECT, with its fallbacks (refused at open; EINVAL on the first write) and with it turned off."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from zckpt.storage import direct_io
from zckpt.storage.sink import HashingSink

B = direct_io.BUF_BYTES
SIZES = [
    [0],
    [1],
    [4095],
    [4096],
    [5000, 3],
    [B],
    [B + 1],
    [3 << 20, B + 7, 123, 2 * B - 5000],
    [100] * 300,
]
DATA = os.urandom(3 * B + (1 << 20))


def _write(path: Path, sizes: list[int]) -> tuple[HashingSink, bytes]:
    sink = HashingSink(path)
    off = 0
    for n in sizes:
        sink.write(memoryview(DATA[off : off + n]))
        off += n
    sink.close()
    return sink, DATA[:off]


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    """``tmp_path``, which must accept ``O_DIRECT``: these tests are about the direct path, so a filesystem
    that refuses it (tmpfs) fails them, naming the fix, instead of passing them without testing anything."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as e:
        pytest.fail(f"{tmp_path}: the filesystem refuses O_DIRECT ({e}); give pytest a --basetemp on disk")
    return tmp_path


@pytest.mark.parametrize("sizes", SIZES, ids=lambda s: f"{len(s)}x{sum(s)}")
def test_bytes_and_hash_match_what_was_written(sizes: list[int], tmp_path: Path) -> None:
    sink, want = _write(tmp_path / "f", sizes)
    assert (tmp_path / "f").read_bytes() == want
    assert sink.hexdigest() == hashlib.sha256(want).hexdigest()


def test_direct_is_used_where_the_filesystem_allows(direct_dir: Path) -> None:
    sink = HashingSink(direct_dir / "f")
    assert sink._direct is not None
    sink.close()


def test_off_and_refused_at_open_write_plainly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCKPT_DIRECT_IO", "0")
    sink, want = _write(tmp_path / "off", SIZES[7])
    assert sink._direct is None and (tmp_path / "off").read_bytes() == want
    monkeypatch.delenv("ZCKPT_DIRECT_IO")

    real_open = os.open

    def refuse(path: object, flags: int, *a: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT refused", str(path))
        return real_open(path, flags, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    sink, want = _write(tmp_path / "refused", SIZES[7])
    assert sink._direct is None and (tmp_path / "refused").read_bytes() == want


def test_einval_on_write_falls_back_mid_file(direct_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwrite
    seen = {"direct": 0}

    def pwrite(fd: int, data: object, off: int) -> int:
        if _is_direct(fd):
            seen["direct"] += 1
            if seen["direct"] >= 2:  # the second direct write is refused: the rest goes plainly
                raise OSError(errno.EINVAL, "invalid argument")
        return real(fd, data, off)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", pwrite)
    sink, want = _write(direct_dir / "f", SIZES[7])
    assert (direct_dir / "f").read_bytes() == want
    assert sink.hexdigest() == hashlib.sha256(want).hexdigest()
    assert seen["direct"] >= 2


def test_write_error_surfaces_as_the_os_error(direct_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: object, off: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    sink = HashingSink(direct_dir / "f")
    assert sink._direct is not None
    with pytest.raises(OSError) as err:
        sink.write(memoryview(DATA[: 3 * B]))  # two full buffers: the first write's error comes back
        sink.close()
    assert err.value.errno == errno.ENOSPC


def _is_direct(fd: int) -> bool:
    import fcntl

    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
