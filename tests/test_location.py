"""A location in a bucket is a ``RemotePath``, never a ``Path``: its path arithmetic agrees with ``pathlib``'s
(the oracle) while ``open``/``os.fspath`` refuse it; local-only entries (``--plot``, the engine's
``save_16bit_model``) refuse an ``s3://`` location in one line and create nothing on the local disk; and a
consolidate from and into a bucket (a moto server on 127.0.0.1) is byte-identical to the local one, its
result naming ``RemotePath`` objects; ``verify`` of a Megatron checkpoint in a bucket matches the local one
(on 532ea05 it raised ``FileNotFoundError: 's3:/ckpts/...'``: the folder became a local ``Path``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePath, PurePosixPath

import _s3
import pytest
from _fixtures import fixture
from typer.testing import CliRunner

import zckpt
from zckpt.cli.app import app
from zckpt.errors import Unsupported
from zckpt.storage.location import local, location
from zckpt.storage.objstore import RemotePath

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})

KEYS = ("run/global_step3/mp_rank_00_model_states.pt", "a/b.tar.gz", "model.safetensors", "dir/", "x")


@pytest.mark.parametrize("key", KEYS)
def test_remote_path_is_no_path_but_does_its_arithmetic(key: str) -> None:
    r = location(f"s3://bkt/{key}")
    assert type(r) is RemotePath
    assert not isinstance(r, (PurePath, os.PathLike))
    with pytest.raises(TypeError):
        os.fspath(r)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        open(r)  # type: ignore[call-overload]  # noqa: SIM115
    # oracle: pathlib on the same key under the bucket (``/bkt/...``), then written back as a URL
    p = PurePosixPath("/bkt", key)
    url = lambda q: "s3:/" + str(q)  # noqa: E731
    assert str(r) == url(p)
    assert (r.name, r.suffix, r.stem) == (p.name, p.suffix, p.stem)
    assert str(r.parent) == url(p.parent)
    assert str(r / "c/d.json") == url(p / "c/d.json")
    assert str(r.with_name("n.bin")) == url(p.with_name("n.bin"))
    assert str(r.with_suffix(".idx")) == url(p.with_suffix(".idx"))
    assert [str(q) for q in r.parents] == [url(q) for q in p.parents][:-1]  # ours stop at the bucket
    assert location(Path(f"s3://bkt/{key}")) == r  # what ``pathlib`` (or typer) makes of the URL
    assert location(r) is r and r == RemotePath.of(str(r)) and hash(r) == hash(RemotePath.of(str(r)))


def test_local_names_stay_paths_and_local_refuses_a_url(tmp_path: Path) -> None:
    assert location(str(tmp_path)) == tmp_path and type(location(str(tmp_path))) is type(tmp_path)
    assert local(tmp_path / "x", "this") == tmp_path / "x"
    with pytest.raises(Unsupported) as e:
        local("s3://bkt/run", "this")
    assert str(e.value) == "s3://bkt/run: this takes a local path, not an s3:// URL"
    assert e.value.hint


def test_plot_into_a_bucket_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--plot`` writes a local file: an ``s3://`` name is refused before any work. (When it was a
    ``Path``, it said ``no folder s3:/bkt`` and, with that folder made, drew into ``./s3:/bkt/p.png``.)"""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:" / "bkt").mkdir(parents=True)  # a local folder by the name a Path makes of the URL
    ck = fixture("ds", "s3_fp32_w2")
    res = runner.invoke(app, ["inspect", str(ck), "--plot", "s3://bkt/p.png"])
    assert res.exit_code == 2 and res.stdout == "", res.output
    assert "s3://bkt/p.png: --plot takes a local path, not an s3:// URL" in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 2 and "Traceback" not in res.stderr  # error + hint
    assert list((tmp_path / "s3:" / "bkt").iterdir()) == []


def test_engine_save_16bit_model_to_a_bucket_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's ``save_16bit_model`` writes a local file: ``s3://...`` is refused, not made a local
    folder ``./s3:/...`` (what ``Path(save_dir)`` did)."""
    import _engine_ref as R

    monkeypatch.chdir(tmp_path)
    eng, _ = R.train(0, 1, R.config(2), 0)
    with pytest.raises(Unsupported, match=r"^s3://ckpts/m: save_16bit_model takes a local path"):
        eng.save_16bit_model("s3://ckpts/m", "model.safetensors")
    assert list(tmp_path.iterdir()) == []
    assert eng.save_16bit_model(str(tmp_path / "m"), "model.safetensors")  # a local folder: as before
    assert (tmp_path / "m" / "model.safetensors").stat().st_size > 0


@pytest.fixture
def s3env(s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    for k, v in _s3.env_for(s3_server.url):
        monkeypatch.setenv(k, v)
    yield s3_server.client()


def test_consolidate_from_and_into_a_bucket_matches_local(s3env: object, tmp_path: Path) -> None:
    """Oracle: the same consolidate from the local fixture into a local file and folder."""
    c = s3env
    src = fixture("ds", "s3_bf16_w3_sub_g2")
    url = _s3.upload(c, src, "ckpts", "loc/in")
    want_file, want_dir = tmp_path / "m.safetensors", tmp_path / "hf"
    zckpt.consolidate(src, want_file, progress=False)
    zckpt.consolidate(src, want_dir, max_shard_size="600B", progress=False)

    got = zckpt.consolidate(url, "s3://ckpts/loc/m.safetensors", progress=False)
    assert type(got.out) is RemotePath and str(got.out) == "s3://ckpts/loc/m.safetensors"
    assert all(type(f) is RemotePath for f in got.files) and not any(isinstance(f, Path) for f in got.files)
    body = c.get_object(Bucket="ckpts", Key="loc/m.safetensors")["Body"].read()  # type: ignore[attr-defined]
    assert body == want_file.read_bytes()

    got = zckpt.consolidate(url, "s3://ckpts/loc/hf", max_shard_size="600B", progress=False)
    names = sorted(f.name for f in got.files if isinstance(f, RemotePath))
    assert names == sorted(p.name for p in want_dir.iterdir()) and len(names) > 3
    for n in names:
        body = c.get_object(Bucket="ckpts", Key=f"loc/hf/{n}")["Body"].read()  # type: ignore[attr-defined]
        assert body == (want_dir / n).read_bytes(), n
    report = zckpt.verify("s3://ckpts/loc/hf", progress=False)
    assert report.ok and report.path == "s3://ckpts/loc/hf", report.problems
    assert all(f.startswith("s3://ckpts/loc/hf/") for f in report.files)


def test_verify_megatron_from_a_bucket_matches_local(s3env: object) -> None:
    """Oracle: ``verify`` of the local copy. (``common.pt``'s zip check opened the URL as a local file when a
    ``RemotePath`` was a ``PathLike``: a bucket's intact ``common.pt`` was reported damaged.)"""
    src = fixture("megatron", "tp1_bf16_modelonly", "ckpt")
    url = _s3.upload(s3env, src, "ckpts", "loc/megatron")
    want = zckpt.verify(src, progress=False)
    got = zckpt.verify(url, progress=False)
    assert want.ok and want.checksums > 0, want.problems
    assert got.ok and got.checksums == want.checksums, got.problems
    assert [f.replace(url, str(src)) for f in got.files] == list(want.files)
