"""Checkpoints in an S3 bucket (a real moto server on 127.0.0.1): every command's output from ``s3://`` inputs
is byte-identical to the local run's (the oracle), through a fault-injecting proxy too, and store errors are
one line, exit 2. The client is configured only by the ``AWS_*`` environment a user sets."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import _s3
import pytest
from _fixtures import fixture
from typer.testing import CliRunner

import zckpt
from zckpt.cli.app import app
from zckpt.storage import objstore
from zckpt.storage.session import Storage

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})

DS_CASES = ("s3_fp32_w2", "s2_bf16_w3_g2", "s1_fp16_w3_g2", "s0_bf16_w2", "s3_bf16_w3_sub_g2")
DCP_CASES = ("fsdp2_w2", "torchtitan_w2", "tp_w2")


@pytest.fixture(scope="module")
def inputs(s3_server: _s3.Server, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """name -> (local path, its copy in the bucket): real DeepSpeed, DCP and HF Trainer fixtures, plus a
    native checkpoint and a sharded HF folder made from one of them locally."""
    c = s3_server.client()
    made = tmp_path_factory.mktemp("made")
    native = made / "native"
    zckpt.reshard(fixture("ds", "s3_fp32_w2"), native, world=2, to="native", progress=False)
    hf = made / "hf"
    zckpt.consolidate(fixture("ds", "s3_bf16_w3_sub_g2"), hf, max_shard_size="600B", progress=False)
    local = {f"ds/{n}": fixture("ds", n) for n in DS_CASES}
    local |= {f"dcp/{n}": fixture("dcp", n, "checkpoint") for n in DCP_CASES}
    local["trainer"] = fixture("trainer", "trainer_z2_w2", "checkpoint-3")
    local["native"] = native
    local["hf"] = hf
    local["file"] = fixture("dcp", "fsdp2_w2", "ref_torch_save.pt")
    out = {}
    for name, p in local.items():
        if p.is_file():
            c.upload_file(str(p), "ckpts", f"in/{name}/{p.name}")  # type: ignore[attr-defined]
            out[name] = (p, f"s3://ckpts/in/{name}/{p.name}")
        else:
            out[name] = (p, _s3.upload(c, p, "ckpts", f"in/{name}"))
    return out


@pytest.fixture
def s3env(s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The client pointed at the server by the user's environment only."""
    for k, v in _s3.env_for(s3_server.url):
        monkeypatch.setenv(k, v)
    yield s3_server.url


@contextlib.contextmanager
def _op(options: dict[str, str] | None = None) -> Iterator[Storage]:
    """One operation's storage, bound while the block runs (what every library call and command makes)."""
    st = Storage(options)
    try:
        with st.bound():
            yield st
    finally:
        st.close()


def _cli(*args: str) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def _same(local: tuple[int, str], remote: tuple[int, str], lp: Path, url: str) -> None:
    assert remote[0] == local[0], remote[1]
    assert remote[1].replace(url, str(lp)) == local[1]


ALL = [f"ds/{n}" for n in DS_CASES] + [f"dcp/{n}" for n in DCP_CASES] + ["trainer", "native", "hf", "file"]


@pytest.mark.parametrize("name", ALL)
def test_inspect_verify_consolidate_from_bucket_match_local(
    name: str, inputs: dict[str, tuple[Path, str]], s3env: str, tmp_path: Path
) -> None:
    lp, url = inputs[name]
    for args in (["inspect", "--all"], ["inspect", "--json"], ["verify"]):
        _same(_cli(*args[:1], str(lp), *args[1:]), _cli(*args[:1], url, *args[1:]), lp, url)
    a, b = tmp_path / "local.safetensors", tmp_path / "remote.safetensors"
    ra, rb = _cli("consolidate", str(lp), str(a)), _cli("consolidate", url, str(b))
    assert ra[0] == rb[0] == 0, rb[1]
    assert a.read_bytes() == b.read_bytes()
    side_b = json.loads((tmp_path / "remote.safetensors.crc32.json").read_text())
    side_a = json.loads((tmp_path / "local.safetensors.crc32.json").read_text())
    assert side_b["crc32"] == side_a["crc32"] and side_b["size"] == side_a["size"]


@pytest.mark.parametrize("name", ["ds/s3_bf16_w3_sub_g2", "dcp/fsdp2_w2", "trainer"])
def test_consolidate_hf_folder_and_diff_from_bucket(
    name: str, inputs: dict[str, tuple[Path, str]], s3env: str, tmp_path: Path
) -> None:
    lp, url = inputs[name]
    a, b = tmp_path / "a", tmp_path / "b"
    assert _cli("consolidate", str(lp), str(a), "--max-shard-size", "600B", "--dtype", "bf16")[0] == 0
    code, out = _cli("consolidate", url, str(b), "--max-shard-size", "600B", "--dtype", "bf16")
    assert code == 0, out
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and len(names) > 3
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
    # diff: bucket against local (equal), bucket against bucket, and the same report as the local run's
    code, out = _cli("diff", url, str(lp))
    assert code == 0, out
    _same(_cli("diff", str(lp), str(a), "--json"), _cli("diff", url, str(a), "--json"), lp, url)
    code, out = _cli("diff", url, url)
    assert code == 0, out


def test_diff_of_two_bucket_checkpoints_matches_local(
    inputs: dict[str, tuple[Path, str]], s3env: str
) -> None:
    (la, ua), (lb, ub) = inputs["ds/s3_fp32_w2"], inputs["native"]
    local = _cli("diff", str(la), str(lb), "--include-optimizer", "--json")
    remote = _cli("diff", ua, ub, "--include-optimizer", "--json")
    assert remote[0] == local[0] == 0, remote[1]
    assert json.loads(remote[1].replace(ua, str(la)).replace(ub, str(lb))) == json.loads(local[1])


def _ds_input(tmp_path: Path) -> Path:
    """A ZeRO-3 DeepSpeed checkpoint of world 2 of a 1.06M-param model (the fixtures are too small for
    byte counts: every file under one 256 KiB block): the engine trains it 2 steps, ``zckpt reshard --to
    deepspeed`` writes DeepSpeed's layout (tests/test_reshard_deepspeed.py: real DeepSpeed resumes it)."""
    import _engine_ref as R
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(R.VOCAB, 512)
            self.l1 = nn.Linear(512, 2048)
            self.l2 = nn.Linear(2048, R.VOCAB)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.l2(torch.tanh(self.l1(self.emb(x))))
            return F.cross_entropy(h.reshape(-1, R.VOCAB), y.reshape(-1))

    torch.manual_seed(0)
    eng, _ = R.train(0, 1, R.config(3), 2, model=Wide())
    eng.save_checkpoint(str(tmp_path / "native"), tag="global_step2")
    eng.destroy()
    zckpt.reshard(tmp_path / "native", tmp_path / "ds", world=2, to="deepspeed", progress=False)
    return tmp_path / "ds"


def test_bytes_fetched_are_what_consolidate_needs(s3_server: _s3.Server, s3env: str, tmp_path: Path) -> None:
    """Consolidating ZeRO-3 from the bucket fetches the fp32 masters and the model-state files, not the Adam
    moments (two thirds of the optimizer files). Oracle: the bytes the output needs, from the files
    themselves: the fp32 output's size (the masters, one element each, and a small header), the model-state
    files read whole (their pickles place each param's master), and four 256 KiB blocks per optimizer file
    (its zip directory at the end, the pickle at the start, and the local header of each of the two moments'
    records, located though not read: measured, 16 requests, 5.68 MB for 4.34 MB of masters)."""
    lp = _ds_input(tmp_path)
    url = _s3.upload(s3_server.client(), lp, "ckpts", "needs/ds")
    st = Storage()
    res = zckpt.consolidate(url, tmp_path / "m.safetensors", dtype="fp32", progress=False, storage=st)
    got = st.stats()
    st.close()
    masters = res.files[0].stat().st_size
    tag = lp / (lp / "latest").read_text().strip()
    optim = sorted(tag.glob("*optim_states.pt"))
    models = sum(f.stat().st_size for f in tag.glob("*model_states.pt"))
    needed = masters + models + 4 * len(optim) * objstore.BLOCK
    assert masters > 4_000_000 and sum(f.stat().st_size for f in optim) > 3 * masters
    assert 0 < got["bytes"] <= needed, (got, needed)
    assert got["requests"] < 40


def test_faults_injected_results_identical(
    inputs: dict[str, tuple[Path, str]],
    s3_server: _s3.Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    proxy = _s3.FaultProxy(s3_server.url, seed=7, p503=0.15, pdrop=0.05, ptrunc=0.1)
    try:
        for k, v in _s3.env_for(proxy.url):
            monkeypatch.setenv(k, v)
        for name in ("ds/s3_bf16_w3_sub_g2", "dcp/torchtitan_w2", "hf"):
            lp, url = inputs[name]
            _same(_cli("verify", str(lp)), _cli("verify", url), lp, url)
            a, b = tmp_path / f"{name.replace('/', '_')}-l.bin", tmp_path / f"{name.replace('/', '_')}-r.bin"
            assert _cli("consolidate", str(lp), str(a))[0] == 0
            code, out = _cli("consolidate", url, str(b))
            assert code == 0, out
            assert a.read_bytes() == b.read_bytes()
        # writes through the faults too: bucket to bucket, then the same bytes as the local output
        lp, url = inputs["ds/s3_bf16_w3_sub_g2"]
        assert _cli("consolidate", str(lp), str(tmp_path / "hf-l"), "--max-shard-size", "600B")[0] == 0
        code, out = _cli("consolidate", url, "s3://ckpts/faults/hf", "--max-shard-size", "600B")
        assert code == 0, out
        c = s3_server.client()
        for f in sorted((tmp_path / "hf-l").iterdir()):
            got = c.get_object(Bucket="ckpts", Key=f"faults/hf/{f.name}")["Body"].read()  # type: ignore[attr-defined]
            assert got == f.read_bytes(), f.name
        assert proxy.counts["faults"] >= 5, proxy.counts  # the faults did happen
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("where", "env", "message"),
    [
        ("s3://ckpts/in/nope", {}, "no such file or folder"),
        ("s3://no-such-bucket-zz/x", {}, "no such bucket"),
        ("s3://ckpts/in/ds/s3_fp32_w2/latest-typo/x.pt", {}, "no such file or folder"),
    ],
)
def test_store_errors_are_one_line(
    where: str, env: dict[str, str], message: str, inputs: dict[str, tuple[Path, str]], s3env: str
) -> None:
    code, out = _cli("inspect", where)
    assert code == 2
    lines = out.strip().splitlines()
    assert lines[0].startswith("error: ") and message in lines[0], out
    assert len(lines) <= 2 and all(x.startswith("hint: ") for x in lines[1:]), out
    assert "Traceback" not in out


def test_storage_option_gives_the_endpoint(
    inputs: dict[str, tuple[Path, str]], s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No AWS_ENDPOINT_URL: ``--storage-option endpoint=...`` (CLI) and ``storage_options=`` (library)."""
    for k, v in _s3.CREDS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    lp, url = inputs["dcp/fsdp2_w2"]
    local = _cli("verify", str(lp))
    remote = _cli("verify", url, "--storage-option", f"endpoint={s3_server.url}")
    _same(local, remote, lp, url)
    r = zckpt.inspect(url, storage_options={"endpoint": s3_server.url})
    assert r.to_json()["params"] == zckpt.inspect(lp).to_json()["params"]
    code, out = _cli("verify", url, "--storage-option", "endpoint")
    assert code == 2 and "not key=value" in out


@pytest.fixture(scope="module")
def auth_server() -> Iterator[_s3.AuthServer]:
    srv = _s3.start_authenticating()
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    ("creds", "message"),
    [
        ("iam", "access denied"),
        (("AKIAWRONGWRONGWRONG0", "wrong"), "the store rejected the credentials"),
        (None, "no credentials for the store"),
    ],
)
def test_credential_errors_are_one_line(
    creds: object, message: str, auth_server: _s3.AuthServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Against a server that checks credentials: a key without permission, an unknown key, no key at all
    (and no profile: HOME is empty). One line each, with a hint, exit 2, no traceback."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", auth_server.url)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    key = auth_server.key if creds == "iam" else creds
    if key is None:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    else:
        assert isinstance(key, tuple)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key[0])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key[1])
    for cmd in (
        ["inspect", "s3://authb/x"],
        ["consolidate", "s3://authb/x", str(tmp_path / "m.safetensors")],
    ):
        code, out = _cli(*cmd)
        lines = out.strip().splitlines()
        assert code == 2 and len(lines) == 2, out
        assert lines[0].startswith("error: s3://authb") and message in lines[0], out
        assert lines[1].startswith("hint: ") and "Traceback" not in out
    assert not (tmp_path / "m.safetensors").exists()


def test_diff_series_from_bucket_matches_local(s3_server: _s3.Server, s3env: str, tmp_path: Path) -> None:
    """``diff --series`` over a run folder in the bucket (two tag folders of real DeepSpeed files)."""
    import shutil

    src = fixture("ds", "s3_fp32_w2", "global_step3")
    run = tmp_path / "run"
    for tag in ("global_step3", "global_step4"):
        shutil.copytree(src, run / tag)
    url = _s3.upload(s3_server.client(), run, "ckpts", "series/run")
    _same(_cli("diff", "--series", str(run), "--json"), _cli("diff", "--series", url, "--json"), run, url)


def _read_sequentially(url: str, lo: int, hi: int, step: int = 300_000) -> bytes:
    got = bytearray(hi - lo)
    at = lo
    while at < hi:  # reads of 300 KB, not aligned to anything
        k = min(step, hi - at)
        objstore.read_into(url, at, memoryview(got)[at - lo : at - lo + k], limit=hi)
        at += k
    return bytes(got)


def test_read_ahead_stream_tiles_the_record_and_stops_at_its_end(
    s3_server: _s3.Server, s3env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sequential reader with ``limit`` (the record's end) gets the exact bytes from one streamed GET per
    ``MAX_REQUEST`` bytes (5 MiB here: 5 + 5 + 5 + the rest), and nothing past ``limit`` is fetched.
    Oracle: the uploaded bytes, and the request sizes ``ahead.Stream`` documents."""
    import random

    from zckpt.storage.objstore import ahead

    data = random.Random(5).randbytes(20 << 20)
    s3_server.client().put_object(Bucket="ckpts", Key="win/obj", Body=data)  # type: ignore[attr-defined]
    url, lo, hi = "s3://ckpts/win/obj", 123_457, (17 << 20) + 999
    for max_request, requests in ((ahead.MAX_REQUEST, 1), (5 << 20, 4)):
        monkeypatch.setattr(ahead, "MAX_REQUEST", max_request)
        with _op({"window_bytes": str(1 << 20)}) as op:
            objstore.size(url)  # the listing: not counted below
            before = op.stats()
            assert _read_sequentially(url, lo, hi) == data[lo:hi]
            st = {k: v - before[k] for k, v in op.stats().items()}
        assert st["bytes"] == hi - lo  # the stream tiles [lo, hi): no byte twice, none past the limit
        assert st["requests"] == requests and st["retries"] == 0


def test_read_ahead_streams_of_one_record_never_fetch_a_byte_twice(s3_server: _s3.Server, s3env: str) -> None:
    """Two readers of one record far apart (a big tensor, then the next one, past the first stream's reach):
    the second reader's stream starts where it reads, and the first stream stops there instead of fetching on
    into bytes the second one fetches (before: a read-ahead's worth, 4 MiB here, came twice). Oracle: the
    uploaded bytes, and the bytes fetched against the record's size plus what the dropped connection had
    delivered past the cut (a body chunk: at least 1 MiB, ``backend.stream``; 2 MiB allowed)."""
    import random

    data = random.Random(6).randbytes(48 << 20)
    s3_server.client().put_object(Bucket="ckpts", Key="two/obj", Body=data)  # type: ignore[attr-defined]
    url, lo, hi = "s3://ckpts/two/obj", 123_457, (48 << 20) - 999
    mid = lo + (24 << 20) + 77  # past the first stream's reach: 4 read-aheads of 4 MiB past what it holds
    with _op({"window_bytes": str(4 << 20)}) as op:
        objstore.size(url)
        before = op.stats()
        got = bytearray(hi - lo)

        def read(a: int, b: int) -> None:  # in reads of 300 KB, as a fill thread reads a tensor
            for at in range(a, b, 300_000):
                k = min(300_000, b - at)
                objstore.read_into(url, at, memoryview(got)[at - lo : at - lo + k], limit=hi)

        read(lo, lo + (1 << 20))  # reader A starts; its stream fetches ahead
        read(mid, hi)  # reader B, past the reach of A's stream: a stream of its own
        read(lo + (1 << 20), mid)  # reader A goes on up to where B began
        fetched = op.stats()["bytes"] - before["bytes"]
    assert bytes(got) == data[lo:hi]
    assert hi - lo <= fetched <= hi - lo + (2 << 20), (fetched, hi - lo)  # before: 55.1 MB, now 51.4


def test_read_ahead_runs_ahead_of_the_reader_but_no_further(s3_server: _s3.Server, s3env: str) -> None:
    """After one small read, the stream's thread fetches on by itself (the network overlaps the reader's
    work) up to the read-ahead (``window_bytes``) past it, and stops there while the reader does not come
    back. Oracle: the byte counts against the configured read-ahead."""
    import time

    data = bytes(range(256)) * (64 << 12)  # 64 MiB
    s3_server.client().put_object(Bucket="ckpts", Key="win/ahead", Body=data)  # type: ignore[attr-defined]
    ahead = 4 << 20
    url = "s3://ckpts/win/ahead"
    with _op({"window_bytes": str(ahead)}) as op:  # closing it closes the stream
        objstore.size(url)
        before = op.stats()["bytes"]
        got = bytearray(1000)
        objstore.read_into(url, 0, memoryview(got), limit=len(data))
        assert bytes(got) == data[:1000]
        deadline = time.monotonic() + 30
        while op.stats()["bytes"] - before < ahead and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        fetched = op.stats()["bytes"] - before
    # past the read-ahead: at most the window being filled and the body's last chunk (1 MiB and a frame)
    assert ahead <= fetched <= 1000 + ahead + (4 << 20) + (2 << 20)


def test_read_ahead_resumes_cut_off_bodies(s3_server: _s3.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a proxy that cuts half the GET bodies off mid-way and answers 503 at random, a streamed
    read resumes from the byte it stopped at: the bytes are exact."""
    import random

    data = random.Random(7).randbytes(24 << 20)
    s3_server.client().put_object(Bucket="ckpts", Key="win/cut", Body=data)  # type: ignore[attr-defined]
    proxy = _s3.FaultProxy(s3_server.url, seed=3, p503=0.1, pdrop=0.0, ptrunc=0.5)
    try:
        for k, v in _s3.env_for(proxy.url):
            monkeypatch.setenv(k, v)
        url = "s3://ckpts/win/cut"
        with _op({"part_bytes": str(5 << 20), "window_bytes": str(2 << 20)}) as op:
            assert _read_sequentially(url, 10, len(data) - 10, step=1 << 20) == data[10:-10]
            assert proxy.counts["faults"] > 0 and op.stats()["retries"] > 0
    finally:
        proxy.stop()


def _profile_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str, profile: str) -> None:
    """A HOME whose ``~/.aws`` holds profile ``zck`` (the server's keys); ``AWS_PROFILE`` names ``profile``;
    no key in the environment: the client must find the credentials through the profile."""
    aws = tmp_path / "home" / ".aws"
    aws.mkdir(parents=True)
    (aws / "credentials").write_text("[zck]\naws_access_key_id = testing\naws_secret_access_key = testing\n")
    (aws / "config").write_text("[profile zck]\nregion = us-east-1\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_PROFILE", profile)
    monkeypatch.setenv("AWS_ENDPOINT_URL", url)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION",
              "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):  # fmt: skip
        monkeypatch.delenv(k, raising=False)


def test_aws_profile_gives_the_credentials(
    inputs: dict[str, tuple[Path, str]],
    s3_server: _s3.Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """``AWS_PROFILE`` with a credentials file in HOME (and no key in the environment) reaches the bucket:
    consolidate's output equals the local run's."""
    lp, url = inputs["ds/s3_fp32_w2"]
    _profile_home(tmp_path, monkeypatch, s3_server.url, "zck")
    assert _cli("consolidate", str(lp), str(tmp_path / "local.safetensors"))[0] == 0
    code, out = _cli("consolidate", url, str(tmp_path / "remote.safetensors"))
    assert code == 0, out
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()


def test_missing_aws_profile_is_one_line(
    inputs: dict[str, tuple[Path, str]],
    s3_server: _s3.Server,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    _, url = inputs["ds/s3_fp32_w2"]
    _profile_home(tmp_path, monkeypatch, s3_server.url, "nosuch")
    code, out = _cli("inspect", url)
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 2, out
    assert lines[0].startswith("error: s3://ckpts"), out
    assert lines[0].endswith(": no AWS profile 'nosuch' in ~/.aws/config or ~/.aws/credentials"), out
    assert lines[1].startswith("hint: check AWS_PROFILE") and "Traceback" not in out


def _dcp_save(d: Path) -> None:
    """A real one-rank ``dcp.save`` of a model and its AdamW state: 24 params of 28 B, 16 KB, 120 KB and
    960 KB (chunk archives that locating reads whole, read through cached blocks, and over a block, read by
    a stream), then their moments."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Module()
    for i in range(6):
        for k, shape in (("a", (64, 64)), ("b", (300, 100)), ("c", (7,)), ("d", (600, 400))):
            model.register_parameter(f"l{i}_{k}", torch.nn.Parameter(torch.randn(*shape)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum((p * p).sum() for p in model.parameters()).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: one rank
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(d))


def test_dcp_consolidate_fetches_each_needed_block_once(
    s3_server: _s3.Server, s3env: str, tmp_path: Path
) -> None:
    """A DCP chunk archive's head and tail blocks, fetched to locate its tensor, also hold the start and end
    of its data. Consolidate from the bucket fetches no more than the blocks under the model's items
    (torch's own ``.metadata`` says where they are) plus the ``.metadata``: no read-ahead stream fetches
    bytes a cached block holds (before: the first 256 KB of each 960 KB chunk's data came twice). The output
    is the local run's, byte for byte."""
    import torch.distributed.checkpoint as dcp

    from zckpt.storage.objstore import read as objread

    lp = tmp_path / "ck"
    _dcp_save(lp)
    url = _s3.upload(s3_server.client(), lp, "ckpts", "fetch/ck")
    md = dcp.FileSystemReader(str(lp)).read_metadata()
    size = (lp / "__0_0.distcp").stat().st_size
    blocks = {
        i
        for idx, info in md.storage_data.items()
        if idx.fqn.startswith("model.")
        for i in range(info.offset // objread.BLOCK, (info.offset + info.length - 1) // objread.BLOCK + 1)
    }
    ideal = sum(min(objread.BLOCK, size - i * objread.BLOCK) for i in blocks)
    ideal += (lp / ".metadata").stat().st_size
    assert ideal < 0.4 * size  # the moments are not needed
    assert _cli("consolidate", lp, tmp_path / "local.safetensors")[0] == 0
    with _op() as op:  # what the command makes: one storage for the whole consolidate
        zckpt.consolidate(url, tmp_path / "remote.safetensors", progress=False)
        got = op.stats()
    assert (tmp_path / "remote.safetensors").read_bytes() == (tmp_path / "local.safetensors").read_bytes()
    assert got["bytes"] <= ideal, (got, ideal)


def test_cache_room_keeps_blocks_while_a_fill_runs(
    s3_server: _s3.Server, s3env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write pipeline announces (and a DCP reader locates) what it queues before reading it: while a
    fill runs, ``cache_room`` keeps that many bytes more of blocks, so the reads find them (a 48-layer DCP
    world-8 consolidate fetched 1.8x its bytes with blocks evicted before use). Afterwards the cache shrinks
    back to ``CACHE_BLOCKS``."""
    from zckpt.storage.objstore import read as objread

    c = s3_server.client()
    blob = bytes(range(256)) * (6 * objread.BLOCK // 256)
    c.put_object(Bucket="ckpts", Key="room/blob", Body=blob)  # type: ignore[attr-defined]
    url = "s3://ckpts/room/blob"
    monkeypatch.setattr(objread, "CACHE_BLOCKS", 2)
    with _op() as op:
        assert objstore.size(url) == len(blob)  # (its size is looked up once, then known)

        def read_all() -> int:
            before = op.stats()["requests"]
            for i in range(6):
                buf = memoryview(bytearray(100))
                objstore.read_into(url, i * objread.BLOCK + 7, buf)
                assert bytes(buf) == blob[i * objread.BLOCK + 7 : i * objread.BLOCK + 107]
            return op.stats()["requests"] - before

        with objstore.cache_room(4 * objread.BLOCK):
            assert read_all() == 6
            assert read_all() == 0  # all six held: 2 + 4 of room
        assert read_all() == 6  # back to 2 blocks: the oldest four were dropped on the way out


def test_verify_from_bucket_streams_each_record_once(
    s3_server: _s3.Server, s3env: str, tmp_path: Path
) -> None:
    """``verify`` of a torch file in the bucket whose one big record (24 MB, three 8 MiB parts) is checked
    through a read-ahead stream: one GET for the record, not one per 8 MiB read (the parts cost moto the
    whole object each: 52 s for a 1.2 GB checkpoint), and each byte fetched once. Oracle: the file's own
    size, its zip records (``zipfile``), and the bytes fetched counted by a proxy in front of the server;
    the report is the local file's."""
    import zipfile

    import torch

    f = tmp_path / "big.pt"
    torch.save({"w": torch.arange(6_000_000, dtype=torch.float32), "b": torch.ones(3)}, f)
    with zipfile.ZipFile(f) as zf:
        big = [i for i in zf.infolist() if i.file_size > objstore.BLOCK]
    assert len(big) == 1 and big[0].file_size == 24_000_000
    c = s3_server.client()
    c.create_bucket(Bucket="verify")  # type: ignore[attr-defined]
    c.upload_file(str(f), "verify", "big.pt")  # type: ignore[attr-defined]
    proxy = _s3.FaultProxy(s3_server.url, p503=0, pdrop=0, ptrunc=0)
    try:
        st = Storage({"endpoint": proxy.url})
        try:
            remote = zckpt.verify("s3://verify/big.pt", progress=False, storage=st)
        finally:
            st.close()
    finally:
        proxy.stop()
    local = zckpt.verify(f, progress=False)
    assert remote.ok and local.ok and remote.checksums == local.checksums > 0
    size = f.stat().st_size
    assert size <= proxy.counts["bytes"] <= size + objstore.BLOCK, (
        proxy.counts,
        size,
    )  # parts: size + 400 KB
    # the size look-up, the end block (zip directory), the head block (pickle, headers), the record's stream
    # and a spare one; in 8 MiB parts: 7
    assert proxy.counts["requests"] <= 5, proxy.counts
