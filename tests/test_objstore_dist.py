"""consolidate and reshard split over 2 gloo processes, bucket to bucket (a moto server on 127.0.0.1): the
objects written are byte-identical to a one-process local run of the same input (the oracle), each process
uploads its own shards, and process 0 publishes the completing objects; the same through the CLI under a real
``torchrun --standalone`` at world 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import _s3
import pytest
from _dist import run
from _fixtures import fixture

import zckpt

pytestmark = pytest.mark.dist

SRC = fixture("ds", "s3_fp32_w3_offall_sub_g2")


def _procs(rank: int, world: int, url: str) -> dict[str, Any]:
    from zckpt.storage.session import Storage

    st = Storage()  # this process's share of the three jobs: its uploads are counted here
    zckpt.consolidate(url, "s3://ckpts/dist/hf", max_shard_size="1KB", progress=False, distributed=True,
                      storage=st)  # fmt: skip
    zckpt.reshard(url, "s3://ckpts/dist/native", world=5, to="native", progress=False, distributed=True,
                  storage=st)  # fmt: skip
    zckpt.reshard(url, "s3://ckpts/dist/dcp", world=4, to="dcp", progress=False, distributed=True, storage=st)
    st.close()
    return {"uploads": st.stats()["uploads"]}


def _tree(p: Path) -> dict[str, bytes]:
    return {f.relative_to(p).as_posix(): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def test_world2_bucket_to_bucket_matches_local(
    s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    c = s3_server.client()
    url = _s3.upload(c, SRC, "ckpts", "dist-in")
    zckpt.consolidate(SRC, tmp_path / "hf", max_shard_size="1KB", progress=False)
    zckpt.reshard(SRC, tmp_path / "native", world=5, to="native", progress=False)
    zckpt.reshard(SRC, tmp_path / "dcp", world=4, to="dcp", progress=False)
    for k, v in _s3.env_for(s3_server.url):
        monkeypatch.setenv(k, v)
    res = run(_procs, 2, url)
    assert all(r["uploads"] > 0 for r in res), res  # both processes uploaded shards of their own
    for name in ("hf", "native", "dcp"):
        got = _fetch(c, f"dist/{name}/", tmp_path / "got" / name)
        assert _tree(got) == _tree(tmp_path / name), name  # DCP's .metadata too, byte for byte


def _two_nodes(rank: int, world: int, url: str) -> dict[str, Any]:
    """As ``_procs``, but process 1 acts as if on another node: rank 0's staging folder is not there, so it
    writes through a stand-in of its own (``remote_staging.Follower``); then a failure of its upload."""
    from _dist import outcome

    from zckpt.storage import objstore, remote_staging
    from zckpt.storage.session import Storage

    made: list[str] = []
    init = remote_staging.Follower.__init__

    def counted(self: Any, url: str, *, is_dir: bool, order: Any) -> None:
        made.append(url)
        init(self, url, is_dir=is_dir, order=order)

    remote_staging.Follower.__init__ = counted  # type: ignore[method-assign]
    if rank == 1:
        remote_staging.on_this_host = lambda ticket: False
    st = Storage()
    opts: dict[str, Any] = {"progress": False, "distributed": True, "storage": st}
    zckpt.consolidate(url, "s3://ckpts/nodes/hf", max_shard_size="1KB", **opts)
    zckpt.reshard(url, "s3://ckpts/nodes/dcp", world=4, to="dcp", **opts)
    uploads = st.stats()["uploads"]
    st.close()
    if rank == 1:  # its small files (sidecars) fail to upload, after its shards streamed

        def fail(path: Path, *a: Any, **k: Any) -> None:
            raise OSError(5, "injected upload error", str(path))

        objstore.upload_file = fail
    failed = outcome(lambda: zckpt.consolidate(url, "s3://ckpts/nodes/failed", max_shard_size="1KB",
                                               progress=False, distributed=True))  # fmt: skip
    return {"uploads": uploads, "failed": failed, "followers": made}


def test_world2_on_two_nodes_bucket_to_bucket(s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:  # fmt: skip
    """Ranks that do not share rank 0's staging folder (several nodes) write the same objects as a
    one-process local run; a failure on the other node leaves no object behind."""
    c = s3_server.client()
    url = _s3.upload(c, SRC, "ckpts", "nodes-in")
    zckpt.consolidate(SRC, tmp_path / "hf", max_shard_size="1KB", progress=False)
    zckpt.reshard(SRC, tmp_path / "dcp", world=4, to="dcp", progress=False)
    for k, v in _s3.env_for(s3_server.url):
        monkeypatch.setenv(k, v)
    res = run(_two_nodes, 2, url)
    assert all(r["uploads"] > 0 for r in res), res
    assert res[0]["followers"] == [] and len(res[1]["followers"]) == 3, res  # hf, dcp, failed
    for name in ("hf", "dcp"):
        got = _fetch(c, f"nodes/{name}/", tmp_path / "got" / name)
        assert _tree(got) == _tree(tmp_path / name), name
    assert res[1]["failed"] == "own:injected upload error" and res[0]["failed"].startswith("peer:"), res
    assert _s3.keys(c, "ckpts", "nodes/failed") == []


def _fetch(c: object, prefix: str, to: Path) -> Path:
    """Every object under ``s3://ckpts/<prefix>`` into the folder ``to``."""
    for key in _s3.keys(c, "ckpts", prefix):
        dst = to / key[len(prefix) :]
        dst.parent.mkdir(parents=True, exist_ok=True)
        c.download_file("ckpts", key, str(dst))  # type: ignore[attr-defined]
    return to


def test_torchrun_world2_cli_bucket_to_bucket(s3_server: _s3.Server, tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 -m zckpt ...`` from the bucket into the bucket: the objects
    are byte-identical to a one-process local run (the oracle), DCP's ``.metadata`` included."""
    c = s3_server.client()
    url = _s3.upload(c, SRC, "ckpts", "tr-in")
    zckpt.consolidate(SRC, tmp_path / "hf", max_shard_size="1KB", progress=False)
    zckpt.reshard(SRC, tmp_path / "dcp", world=3, to="dcp", progress=False)
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, **dict(_s3.env_for(s3_server.url)), "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    jobs = {
        "hf": ["consolidate", url, "s3://ckpts/tr/hf", "--max-shard-size", "1KB"],
        "dcp": ["reshard", url, "s3://ckpts/tr/dcp", "--world", "3", "--to", "dcp"],
    }
    for name, args in jobs.items():
        p = subprocess.run([*torchrun, "zckpt", *args, "--no-progress"], env=env, capture_output=True,
                           text=True, timeout=300)  # fmt: skip
        assert p.returncode == 0, (name, p.stdout[-2000:], p.stderr[-3000:])
        got = _fetch(c, f"tr/{name}/", tmp_path / "got" / name)
        assert _tree(got) == _tree(tmp_path / name), name
