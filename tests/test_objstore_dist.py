"""consolidate and reshard split over 2 gloo processes, bucket to bucket (a moto server on 127.0.0.1): the
objects written are byte-identical to a one-process local run of the same input (the oracle), each process
uploads its own shards, and process 0 publishes the completing objects."""

from __future__ import annotations

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
    from zckpt.io import objstore

    objstore.reset_stats()
    zckpt.consolidate(url, "s3://ckpts/dist/hf", max_shard_size="1KB", progress=False)
    zckpt.reshard(url, "s3://ckpts/dist/native", world=5, to="native", progress=False)
    zckpt.reshard(url, "s3://ckpts/dist/dcp", world=4, to="dcp", progress=False)
    return {"uploads": objstore.stats()["uploads"]}


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
        got = tmp_path / "got" / name
        for key in _s3.keys(c, "ckpts", f"dist/{name}/"):
            dst = got / key[len(f"dist/{name}/") :]
            dst.parent.mkdir(parents=True, exist_ok=True)
            c.download_file("ckpts", key, str(dst))  # type: ignore[attr-defined]
        assert _tree(got) == _tree(tmp_path / name), name  # DCP's .metadata too, byte for byte
