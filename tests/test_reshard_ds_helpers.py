"""``zckpt reshard`` of a plain DeepSpeed save folder keeps the helper scripts DeepSpeed 0.19.8's
``save_checkpoint`` writes beside ``latest`` (``zero_to_fp32.py``, ``zero_to_torch.py``:
``DeepSpeedEngine._copy_recovery_script``), byte for byte and mode bits kept, and never runs them.

Oracle: the source bytes. The scripts here are DeepSpeed's own when ``.venv-ds`` is present, else stand-ins
that would fail loudly if anything ran them; either way the output must hold the same bytes.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest

from zckpt.ops.reshard import reshard

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures" / "ds" / "s2_fp32_w2_g2"
DS_UTILS = sorted((ROOT / ".venv-ds" / "lib").glob("python3*/site-packages/deepspeed/utils"))
HELPERS = ("zero_to_fp32.py", "zero_to_torch.py")


def _plain_folder(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(FIX, src)  # a missing fixture is an error
    for name in HELPERS:
        if DS_UTILS:
            shutil.copyfile(DS_UTILS[0] / name, src / name)
        else:
            (src / name).write_text(f"raise SystemExit('{name} must never be executed by zckpt')\n")
        (src / name).chmod((src / name).stat().st_mode | stat.S_IEXEC)  # as DeepSpeed leaves them
    return src


@pytest.mark.parametrize("world", [1, 3])
def test_plain_deepspeed_folder_keeps_helper_scripts(tmp_path: Path, world: int) -> None:
    src = _plain_folder(tmp_path)
    out = tmp_path / "out"
    reshard(src, out, world=world, progress=False)
    for name in HELPERS:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
        assert (out / name).stat().st_mode & stat.S_IEXEC, name
    assert (out / "latest").is_file()


def test_other_output_formats_get_no_helper_scripts(tmp_path: Path) -> None:
    src = _plain_folder(tmp_path)
    reshard(src, tmp_path / "native", world=2, to="native", progress=False)
    assert not any((tmp_path / "native" / n).exists() for n in HELPERS)


def test_overwrite_replaces_the_helper_scripts_it_wrote(tmp_path: Path) -> None:
    src = _plain_folder(tmp_path)
    out = tmp_path / "out"
    reshard(src, out, world=2, progress=False)
    reshard(src, out, world=1, overwrite=True, progress=False)
    assert all((out / n).read_bytes() == (src / n).read_bytes() for n in HELPERS)
