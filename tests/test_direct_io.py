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


def test_a_size_known_up_front_is_allocated_and_the_file_ends_where_writing_did(direct_dir: Path) -> None:
    """``HashingSink(size=)``: the blocks are allocated at open (``fallocate``; this filesystem allows it),
    the bytes written equal the input, and a file that got fewer bytes than announced has no zeros past
    them."""
    want = DATA[: 2 * B + 5000]
    path = direct_dir / "f"
    sink = HashingSink(path, size=len(want))
    st = os.stat(path)
    assert st.st_size == len(want) and st.st_blocks * 512 >= len(want), st
    sink.write(memoryview(want))
    sink.close()
    assert path.read_bytes() == want
    short = direct_dir / "short"
    sink = HashingSink(short, size=len(want))
    sink.write(memoryview(want[: B + 3]))
    sink.close()
    assert short.read_bytes() == want[: B + 3]


def test_a_size_past_the_file_limit_fails_at_open(tmp_path: Path) -> None:
    """Announced bytes the file may not hold (``RLIMIT_FSIZE``, SIGXFSZ ignored: as a full disk would): the
    sink raises EFBIG at open, before a byte is written, and leaves its descriptor closed."""
    code = (
        "import errno, os, resource, signal, sys\n"
        "from pathlib import Path\n"
        "from zckpt.storage.sink import HashingSink\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
        "fds = len(os.listdir('/proc/self/fd'))\n"
        "try:\n"
        "    HashingSink(Path(sys.argv[1]), size=8 << 20)\n"
        "except OSError as e:\n"
        "    assert e.errno == errno.EFBIG, e\n"
        "    assert len(os.listdir('/proc/self/fd')) == fds\n"
        "    sys.exit(7)\n"
    )
    import subprocess
    import sys

    path = tmp_path / "f"
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=False)
    assert r.returncode == 7, r.stderr
    assert path.stat().st_size == 0
