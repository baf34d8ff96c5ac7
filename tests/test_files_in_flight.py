"""Several output files written at once (``zckpt.stream.pipeline.each_file``, on by default from 8 cores): the
bytes are those of one file after another, and a failure in one file publishes nothing. This machine has 2
cores, where the default is one file at a time, so the tests set ``ZCKPT_FILES``."""

from __future__ import annotations

from pathlib import Path

import pytest

import zckpt
from tests._fixtures import fixture
from zckpt.stream import pipeline

SRC = "gpt2_s3_bf16_w2"


def _files(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


def test_files_in_flight_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZCKPT_FILES", raising=False)
    monkeypatch.setattr(pipeline, "_cores", lambda: 16)
    assert pipeline.files_in_flight(8) == 4 and pipeline.files_in_flight(2) == 2
    monkeypatch.setattr(pipeline, "_cores", lambda: 2)
    assert pipeline.files_in_flight(8) == 1  # the 2-core machine writes one file after another
    monkeypatch.setenv("ZCKPT_FILES", "3")
    assert pipeline.files_in_flight(8) == 3


def test_sharded_consolidate_and_reshard_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = fixture("ds", SRC)
    out: dict[str, dict[str, bytes]] = {}
    for k in ("1", "3"):
        monkeypatch.setenv("ZCKPT_FILES", k)
        r = zckpt.consolidate(src, tmp_path / f"hf{k}", dtype="fp32", max_shard_size="20KB", progress=False)
        assert len([f for f in r.files if str(f).endswith(".safetensors")]) >= 3
        zckpt.reshard(src, tmp_path / f"w{k}", world=4, progress=False)
        out[k] = {
            **_files(tmp_path / f"hf{k}"),
            **{f"w/{n}": b for n, b in _files(tmp_path / f"w{k}").items()},
        }
    assert out["1"].keys() == out["3"].keys()
    assert [n for n in out["1"] if out["1"][n] != out["3"][n]] == []


def test_failed_shard_publishes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCKPT_FILES", "3")
    real = pipeline.each_file  # shards imports it when it writes, so the patched one is what it calls

    def one_fails(write, jobs):  # type: ignore[no-untyped-def]
        def wrapped(job):  # type: ignore[no-untyped-def]
            if job is jobs[1]:
                raise OSError(28, "No space left on device")
            return write(job)

        return real(wrapped, jobs)

    monkeypatch.setattr(pipeline, "each_file", one_fails)
    with pytest.raises(zckpt.errors.WriteFailed, match="No space left"):
        zckpt.consolidate(
            fixture("ds", SRC), tmp_path / "hf", dtype="fp32", max_shard_size="20KB", progress=False
        )
    assert not (tmp_path / "hf").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging folder left behind
