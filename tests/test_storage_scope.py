"""Issue 38: the library is reentrant and nothing found on disk routes an output.

Each operation owns its storage (``zckpt.Storage``): options, clients, listings and caches. Oracles: a local
run of the same call, the bucket's objects read by another client (boto3), and the bytes on disk.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import _s3
import pytest
from _fixtures import fixture

import zckpt
from zckpt.errors import ZckptError

SRC = fixture("ds", "s3_fp32_w2")


@pytest.fixture
def s3env(s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for k, v in _s3.env_for(s3_server.url):
        monkeypatch.setenv(k, v)
    yield s3_server.url


def test_a_marker_file_never_routes_a_local_output(s3env: str, s3_server: _s3.Server, tmp_path: Path) -> None:
    """A ``.zckpt-remote.json`` naming a bucket, put in a parent folder of a local output (as a killed s3 run
    left them, or another user could in a shared folder): the output is written where the caller said,
    nothing goes to the bucket (before: the data went to ``s3://ckpts/stolen`` with the caller's keys)."""
    shared = tmp_path / "shared"
    (shared / "me").mkdir(parents=True)
    for d in (shared, shared / "me"):
        (d / ".zckpt-remote.json").write_text(json.dumps({"dest": "s3://ckpts/stolen", "is_dir": True}))
    out = shared / "me" / "model.safetensors"
    res = zckpt.consolidate(SRC, out, progress=False)
    ref = zckpt.consolidate(SRC, tmp_path / "ref.safetensors", progress=False)
    assert out.is_file() and out.read_bytes() == Path(ref.files[0]).read_bytes()
    assert [Path(f) for f in res.files][0] == out
    assert _s3.keys(s3_server.client(), "ckpts", "stolen/") == []


def test_a_long_lived_process_sees_the_new_latest(s3env: str, s3_server: _s3.Server, tmp_path: Path) -> None:
    """In one process: open a run in the bucket, another writer then adds a tag and moves ``latest``; the
    next open sees it (before: the process-wide listing cache still said the old tag). A checkpoint kept
    open keeps its own view."""
    c = s3_server.client()
    url = _s3.upload(c, SRC, "ckpts", "live/run")
    first = zckpt.open(url)
    assert first.meta.tag == "global_step3"
    run = tmp_path / "run"
    shutil.copytree(SRC / "global_step3", run / "global_step99")
    _s3.upload(c, run, "ckpts", "live/run")
    c.put_object(Bucket="ckpts", Key="live/run/latest", Body=b"global_step99")  # type: ignore[attr-defined]
    with zckpt.open(url) as again:
        assert again.meta.tag == "global_step99"
    assert first.meta.tag == "global_step3" and len(first) > 0
    first.close()


def test_calls_in_threads_with_different_options_share_nothing(
    s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads, each calling ``zckpt.inspect`` many times with its own ``storage_options``: one with the
    server's endpoint, one with a closed port. Every good call gives the local result, every bad call fails
    with "connection refused" (before: ``configure`` was process-wide, so each call reconfigured the other
    thread's client)."""
    for k, v in _s3.CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    url = _s3.upload(s3_server.client(), SRC, "ckpts", "threads/run")
    want = zckpt.inspect(SRC).to_json()["params"]
    good = {"endpoint": s3_server.url}
    bad = {"endpoint": f"http://127.0.0.1:{_s3.free_port()}"}
    got: dict[str, list[str]] = {"good": [], "bad": []}

    def loop(name: str, opts: dict[str, str]) -> None:
        for _ in range(8):
            try:
                r = zckpt.inspect(url, storage_options=opts)
                got[name].append("same" if r.to_json()["params"] == want else "different")
            except ZckptError as e:
                got[name].append(str(e))

    ts = [threading.Thread(target=loop, args=a) for a in (("good", good), ("bad", bad))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert got["good"] == ["same"] * 8, got["good"]
    assert len(got["bad"]) == 8 and all("connection refused" in m for m in got["bad"]), got["bad"]


def test_each_storage_counts_its_own_requests(s3env: str, s3_server: _s3.Server, tmp_path: Path) -> None:
    """Two operations with storages of their own: each one's figures are its requests alone, and a storage
    passed to two calls adds them up (the caller owns it)."""
    url = _s3.upload(s3_server.client(), SRC, "ckpts", "stats/run")
    a, b = zckpt.Storage(), zckpt.Storage()
    zckpt.inspect(url, storage=a)
    one = a.stats()["requests"]
    zckpt.consolidate(url, tmp_path / "m.safetensors", progress=False, storage=b)
    assert one > 0 and b.stats()["requests"] > 0
    assert a.stats()["requests"] == one  # b's requests are not a's
    zckpt.inspect(url, storage=a)
    assert a.stats()["requests"] == one  # the same storage: its listings and blocks are kept
    a.close()
    b.close()
