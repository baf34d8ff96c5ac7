"""Outputs in an S3 bucket (a real moto server on 127.0.0.1): ``consolidate`` and ``reshard`` to ``s3://``
write the same bytes as the local run, publish the completing object last, refuse an existing output without
``--overwrite``, leave nothing behind on failure, and never look complete after a SIGKILL."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import _s3
import _slow_writes
import pytest
from _fixtures import fixture
from typer.testing import CliRunner

from zckpt.cli.app import app
from zckpt.storage import objstore

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})
SRC = "ds/s3_bf16_w3_sub_g2"


@pytest.fixture(scope="module")
def src(s3_server: _s3.Server) -> tuple[Path, str]:
    lp = fixture(*SRC.split("/"))
    return lp, _s3.upload(s3_server.client(), lp, "ckpts", f"win/{SRC}")


@pytest.fixture
def s3env(s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    for k, v in _s3.env_for(s3_server.url):
        monkeypatch.setenv(k, v)
    yield s3_server.client()


def _cli(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def _download(client: object, url: str, to: Path) -> list[str]:
    """Every object under ``url`` into the folder ``to``; their names relative to ``url``."""
    u = objstore.parse(url)
    assert u is not None
    names = []
    for k in _s3.keys(client, u.bucket, u.key + "/"):
        rel = k[len(u.key) + 1 :]
        (to / rel).parent.mkdir(parents=True, exist_ok=True)
        client.download_file(u.bucket, k, str(to / rel))  # type: ignore[attr-defined]
        names.append(rel)
    return sorted(names)


def _tree(p: Path) -> dict[str, bytes]:
    """Every file's bytes (DCP's ``.metadata`` included: its ``save_id`` is derived from the content)."""
    return {f.relative_to(p).as_posix(): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def test_consolidate_to_bucket_is_byte_identical(
    src: tuple[Path, str], s3env: object, tmp_path: Path
) -> None:
    lp, url = src
    c = s3env
    # single file: it appears whole, with its sidecar
    assert _cli("consolidate", lp, tmp_path / "m.safetensors")[0] == 0
    code, out = _cli("consolidate", url, "s3://ckpts/wout/m.safetensors")
    assert code == 0, out
    assert _s3.keys(c, "ckpts", "wout/") == ["wout/m.safetensors", "wout/m.safetensors.crc32.json"]
    body = c.get_object(Bucket="ckpts", Key="wout/m.safetensors")["Body"].read()  # type: ignore[attr-defined]
    assert body == (tmp_path / "m.safetensors").read_bytes()
    # an existing output is refused, and replaced with --overwrite
    code, out = _cli("consolidate", url, "s3://ckpts/wout/m.safetensors")
    assert code == 2 and "already exists" in out and "--overwrite" in out
    assert _cli("consolidate", url, "s3://ckpts/wout/m.safetensors", "--overwrite", "--dtype", "bf16")[0] == 0
    # a sharded HF folder
    assert _cli("consolidate", lp, tmp_path / "hf", "--max-shard-size", "600B")[0] == 0
    code, out = _cli("consolidate", url, "s3://ckpts/wout/hf", "--max-shard-size", "600B")
    assert code == 0, out
    names = _download(c, "s3://ckpts/wout/hf", tmp_path / "got")
    assert len(names) > 4 and _tree(tmp_path / "got") == _tree(tmp_path / "hf")
    assert _cli("verify", "s3://ckpts/wout/hf")[0] == 0
    assert not c.list_multipart_uploads(Bucket="ckpts").get("Uploads")  # type: ignore[attr-defined]


@pytest.mark.parametrize("to", ["deepspeed", "native", "dcp"])
def test_reshard_bucket_to_bucket_is_byte_identical(
    to: str, src: tuple[Path, str], s3env: object, tmp_path: Path
) -> None:
    lp, url = src
    assert _cli("reshard", lp, tmp_path / "local", "--world", "2", "--to", to)[0] == 0
    dst = f"s3://ckpts/wres/{to}"
    code, out = _cli("reshard", url, dst, "--world", "2", "--to", to)
    assert code == 0, out
    _download(s3env, dst, tmp_path / "got")
    assert _tree(tmp_path / "got") == _tree(tmp_path / "local")
    assert _cli("verify", dst)[0] == 0
    code, out = _cli("reshard", url, dst, "--world", "2", "--to", to)
    assert code == 2 and "already exists" in out


def test_publish_order_completing_object_last(src: tuple[Path, str], s3_server: _s3.Server, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Through a logging proxy: every data object is complete before the index, the manifest or
    ``.metadata`` is written, and ``latest`` is written last of all."""
    proxy = _s3.FaultProxy(s3_server.url, p503=0, pdrop=0, ptrunc=0)
    try:
        for k, v in _s3.env_for(proxy.url):
            monkeypatch.setenv(k, v)
        for to, last in (("native", "manifest.json"), ("dcp", ".metadata")):
            proxy.log.clear()
            assert _cli("reshard", src[1], f"s3://ckpts/word/{to}", "--world", "2", "--to", to)[0] == 0
            writes = [p for m, p in proxy.log if m in ("PUT", "POST") and "partNumber" not in p]
            done = [p.split("?")[0].rsplit("/", 1)[-1] for p in writes if "uploads" not in p.split("?")[-1]]
            assert done and last in done, done
            i = done.index(last)
            assert all(
                n.endswith((".sha256", ".sha256.json", ".crc32.json")) or n in (last, "latest")
                for n in done[i:]
            ), done
            if to == "native":
                assert done[-1] == "latest", done
        proxy.log.clear()
        assert _cli("consolidate", src[1], "s3://ckpts/word/hf", "--max-shard-size", "600B")[0] == 0
        done = [p.split("?")[0].rsplit("/", 1)[-1] for m, p in proxy.log if m in ("PUT", "POST")]
        assert done[-1] == "model.safetensors.index.json", done
    finally:
        proxy.stop()


def test_failure_leaves_nothing(
    src: tuple[Path, str], s3env: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completing object's upload fails: the data objects already uploaded are deleted, no multipart
    upload is left, and the error is one line."""
    real = objstore.upload_file

    def failing(local: object, url: object, *, create: bool = False) -> None:
        if str(url).endswith("manifest.json"):
            raise objstore.error(PermissionError("AccessDenied"), url)
        real(local, url, create=create)  # type: ignore[arg-type]

    monkeypatch.setattr(objstore, "upload_file", failing)
    code, out = _cli("reshard", src[1], "s3://ckpts/wfail/n", "--world", "2", "--to", "native")
    assert code == 2 and "access denied" in out, out
    assert _s3.keys(s3env, "ckpts", "wfail/") == []
    assert not s3env.list_multipart_uploads(Bucket="ckpts").get("Uploads")  # type: ignore[attr-defined]


@pytest.mark.slow
def test_sigkill_mid_upload_never_looks_complete(
    src: tuple[Path, str], s3_server: _s3.Server, s3env: object, tmp_path: Path
) -> None:
    """Kill ``reshard --to native`` at 20 random moments (half uniform over an uninterrupted run's duration,
    half within 0.3 s of the first object's upload, each write slowed by 0.2 s): the
    output is absent, or holds data objects without the manifest and ``latest`` (an incomplete checkpoint
    that does not look complete), or is complete and verifies clean: the tag folder once its manifest is
    there, the save folder once ``latest`` is. Never a manifest without its data."""
    env = {**os.environ, **dict(_s3.env_for(s3_server.url)), "ZCKPT_TEST_WRITE_DELAY": "0.2",
           "PYTHONPATH": _slow_writes.child_pythonpath(Path(__file__).resolve().parents[1]),
           "TMPDIR": str(tmp_path)}  # fmt: skip  # a killed run's local stand-in stays: here, not in /tmp
    c = s3_server.client()

    def launch(dst: str) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            "-m",
            "zckpt.cli.app",
            "reshard",
            src[1],
            dst,
            "--world",
            "2",
            "--to",
            "native",
        ]
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    t0 = time.perf_counter()
    assert launch("s3://ckpts/wkill/calibrate").wait() == 0
    took = time.perf_counter() - t0
    rng = random.Random(3)
    verdicts = []
    for i in range(20):
        dst = f"s3://ckpts/wkill/{i}"
        p = launch(dst)
        if i % 2:  # uniform over the run
            time.sleep(rng.uniform(0.3, 1.1) * took)
        else:  # soon after the first object shows: in the middle of the uploads, whatever the run's pace
            deadline = time.monotonic() + 2 * took
            while (
                not _s3.keys(c, "ckpts", f"wkill/{i}/") and p.poll() is None and time.monotonic() < deadline
            ):  # a listing costs ~6 ms of this process's CPU (client and in-process server): every 20 ms,
                time.sleep(0.02)  # not 5 (polling was 21 of the test's 22 s of CPU here, and held the GIL)
            time.sleep(rng.uniform(0.0, 0.3))
        p.send_signal(signal.SIGKILL)
        p.wait()
        names = _s3.keys(c, "ckpts", f"wkill/{i}/")
        manifests = [n for n in names if n.endswith("/manifest.json")]
        has_latest = any(n.endswith("/latest") for n in names)
        looks_complete = bool(manifests) or has_latest
        if looks_complete:
            assert manifests, names  # ``latest`` moves last: never before the tag's manifest
            # killed between the tag's manifest and ``latest``: the tag is complete, the save folder does not
            # name it yet; either way what looks complete verifies clean
            target = dst if has_latest else f"s3://ckpts/{manifests[0].rsplit('/', 1)[0]}"
            assert _cli("verify", target)[0] == 0, names
        verdicts.append("complete" if looks_complete else "partial" if names else "absent")
    assert "partial" in verdicts, verdicts  # kills did land in the middle of the uploads
