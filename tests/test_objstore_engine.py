"""The engine's ``save_checkpoint`` / ``load_checkpoint`` with an ``s3://`` folder (a moto server on
127.0.0.1), synchronous and asynchronous: the objects are byte-identical to a local save of the same state
(rank files; the manifest but for the config's writer block), ``latest`` is written last, and loading from
the bucket resumes exactly like an engine loaded from the local folder (oracle: that local resume)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _engine_ref as R
import _s3
import pytest


@pytest.fixture
def s3env(s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for k, v in _s3.env_for(s3_server.url):
        monkeypatch.setenv(k, v)
    yield s3_server.client()


def _get(c: Any, key: str) -> bytes:
    return c.get_object(Bucket="ckpts", Key=key)["Body"].read()  # type: ignore[no-any-return]


def _gen(c: Any, key: str) -> str:
    """The generation the manifest at ``key`` names (a save into a bucket names its rank files with it)."""
    g = json.loads(_get(c, key))["generation"]
    assert isinstance(g, str) and len(g) == 17 and g.startswith("g"), g
    return g


def _as_local(m: dict[str, Any]) -> dict[str, Any]:
    """A bucket save's manifest as the local save of the same state writes it: no generation in the rank
    files' names, version 2."""
    m = json.loads(json.dumps(m))
    gen = m.pop("generation")
    m["version"] = 2
    m["files"] = {k.replace(f".{gen}.", "."): v for k, v in m["files"].items()}
    return m


def _strip_writer(m: dict[str, Any]) -> dict[str, Any]:
    m = json.loads(json.dumps(m))
    m["config"].get("checkpoint", {}).pop("writer", None)
    if m["config"].get("checkpoint") == {}:
        del m["config"]["checkpoint"]
    return m


@pytest.mark.parametrize("decoupled", [False, True])
def test_engine_saves_to_and_resumes_from_the_bucket(decoupled: bool, s3env: Any, tmp_path: Path) -> None:
    c = s3env
    cfg = {**R.config(3), "checkpoint": {"writer": {"decoupled": True}}} if decoupled else R.config(3)
    eng, _ = R.train(0, 1, cfg, 3)
    eng.save_checkpoint(str(tmp_path / "local"), tag="t")
    url = f"s3://ckpts/engine-{int(decoupled)}"
    eng.save_checkpoint(url, tag="t")
    eng.wait_for_checkpoint() if decoupled else None
    pre = f"engine-{int(decoupled)}"
    gen = _gen(c, f"{pre}/t/manifest.json")
    keys = _s3.keys(c, "ckpts", f"{pre}/")
    assert keys == [f"{pre}/{n}" for n in ("latest", "t/manifest.json", f"t/rank_00000.{gen}.safetensors")]
    assert _get(c, f"{pre}/latest") == b"t"
    local = tmp_path / "local" / "t"
    assert _get(c, f"{pre}/t/rank_00000.{gen}.safetensors") == (local / "rank_00000.safetensors").read_bytes()
    got = json.loads(_get(c, f"{pre}/t/manifest.json"))
    assert _strip_writer(_as_local(got)) == _strip_writer(json.loads((local / "manifest.json").read_text()))
    # resume from the bucket == resume from the local folder
    want_eng, _ = R.train(0, 1, cfg, 0)
    want_eng.load_checkpoint(str(tmp_path / "local"), tag="t")
    _, want = R.train(0, 1, cfg, 2, first=3, engine_=want_eng)
    fresh, _ = R.train(0, 1, cfg, 0)
    path, _ = fresh.load_checkpoint(url)
    assert path == f"{url}/t/rank_00000.{gen}.safetensors"  # the object it read, as it is named in the bucket
    _, resumed = R.train(0, 1, cfg, 2, first=3, engine_=fresh)
    assert resumed == want
    for e in (eng, want_eng, fresh):
        e.destroy()


def test_load_from_the_bucket_waits_for_the_save_in_flight(
    s3env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 38: ``load_checkpoint(url)`` right after a decoupled ``save_checkpoint(url)`` waits for that
    save to be published (the background write is slowed from outside), then loads it: the resumed run
    equals one resumed from a local save of the same state."""
    import time

    from engine.checkpoint import async_save

    cfg = {**R.config(3), "checkpoint": {"writer": {"decoupled": True}}}
    eng, _ = R.train(0, 1, cfg, 3)
    eng.save_checkpoint(str(tmp_path / "local"), tag="t")
    eng.wait_for_checkpoint()
    real = async_save.W.write_rank_views

    def slow(*a: Any, **k: Any) -> Any:
        time.sleep(1.5)
        return real(*a, **k)

    monkeypatch.setattr(async_save.W, "write_rank_views", slow)
    url = "s3://ckpts/inflight"
    eng.save_checkpoint(url, tag="t")
    path, _ = eng.load_checkpoint(url)  # the save above is still writing: this must wait for it
    assert path is not None
    _, resumed = R.train(0, 1, cfg, 2, first=3, engine_=eng)
    want_eng, _ = R.train(0, 1, cfg, 0)
    want_eng.load_checkpoint(str(tmp_path / "local"), tag="t")
    _, want = R.train(0, 1, cfg, 2, first=3, engine_=want_eng)
    assert resumed == want
    for e in (eng, want_eng):
        e.destroy()


def _boom(*a: Any, **k: Any) -> Any:
    raise OSError(5, "injected write error")


def _two_nodes(rank: int, world: int, url: str, local: str, decoupled: bool) -> dict[str, Any]:
    """World 2, process 1 acting as another node (a temporary folder of its own, so rank 0's stand-in is not
    there): a save, then one that fails on rank 0 after process 1 uploaded its rank file."""
    import os
    import tempfile

    from zckpt.formats.native import write as W

    if rank == 1:
        tempfile.tempdir = tempfile.mkdtemp(prefix="zckpt-node1-")
    cfg = {**R.config(3), "checkpoint": {"writer": {"decoupled": True}}} if decoupled else R.config(3)
    eng, _ = R.train(rank, world, cfg, 2)
    for dest in (local, url):
        eng.save_checkpoint(dest, tag="t")
        eng.wait_for_checkpoint()
    name = "write_rank_views" if decoupled else "write_rank"
    real = getattr(W, name)
    if rank == 0:
        setattr(W, name, _boom)
    try:
        eng.save_checkpoint(url, tag="bad")
        eng.wait_for_checkpoint()
        failure = "none"
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        failure = type(e).__name__ if not isinstance(e.__cause__, OSError) else "OSError"
    setattr(W, name, real)
    eng.destroy()
    left = [f for f in os.listdir(tempfile.gettempdir()) if f.startswith("zckpt-s3-staging-")]
    return {"failure": failure, "left": left if rank == 1 else []}


@pytest.mark.parametrize("decoupled", [False, True])
def test_engine_save_from_two_nodes(decoupled: bool, s3env: Any, tmp_path: Path) -> None:
    """Ranks on different nodes save one checkpoint to the bucket (sync and async): its objects equal a local
    save's; a save that fails on rank 0 deletes the rank file the other node uploaded; no stand-in is left on
    that node."""
    from _dist import run

    c = s3env
    pre = f"nodes-engine-{int(decoupled)}"
    res = run(_two_nodes, 2, f"s3://ckpts/{pre}", str(tmp_path / "local"), decoupled)
    assert [r["failure"] for r in res] == ["OSError", "CheckpointSaveError"], res
    assert res[1]["left"] == [], res
    keys = _s3.keys(c, "ckpts", f"{pre}/")
    gen = _gen(c, f"{pre}/t/manifest.json")
    names = (
        "latest",
        "t/manifest.json",
        f"t/rank_00000.{gen}.safetensors",
        f"t/rank_00001.{gen}.safetensors",
    )
    assert keys == [f"{pre}/{n}" for n in names], keys
    local = tmp_path / "local" / "t"
    for r in (0, 1):
        name = f"rank_{r:05d}.safetensors"
        assert _get(c, f"{pre}/t/rank_{r:05d}.{gen}.safetensors") == (local / name).read_bytes(), name
    got = json.loads(_get(c, f"{pre}/t/manifest.json"))
    assert _strip_writer(_as_local(got)) == _strip_writer(json.loads((local / "manifest.json").read_text()))
    assert _get(c, f"{pre}/latest") == b"t"
