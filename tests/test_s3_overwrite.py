"""Issue 38: ``--overwrite`` into a bucket, and a command interrupted while it uploads.

Through a relay (``_s3.FaultProxy``) in front of a real S3 server that refuses chosen requests (403, not
retried) or holds one while the command is interrupted. Oracles: the objects in the bucket before the
command, ``zckpt verify``, and consolidations compared with the same command run on local paths.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _s3
import pytest
from _fixtures import fixture
from typer.testing import CliRunner

from zckpt.cli.app import app

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})
SRC = fixture("ds", "s3_fp32_w2")


def _cli(*args: object) -> tuple[int, str]:
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def _objects(c: Any, prefix: str) -> dict[str, bytes]:
    return {k: c.get_object(Bucket="ckpts", Key=k)["Body"].read() for k in _s3.keys(c, "ckpts", prefix + "/")}


def _model(where: object, tmp: Path, name: str) -> bytes:
    out = tmp / f"{name}.safetensors"
    code, text = _cli("consolidate", where, out, "--dtype", "fp32")
    assert code == 0, text
    return out.read_bytes()


@pytest.mark.parametrize(("to", "completing"), [("native", "manifest.json"), ("dcp", ".metadata")])
def test_failed_overwrite_keeps_the_previous_output(
    to: str, completing: str, relay: _s3.FaultProxy, s3_server: _s3.Server, tmp_path: Path
) -> None:
    """A reshard that replaces an output in the bucket (world 2 -> 3) and fails when its completing object is
    written: the bucket holds the previous output, object for object; it verifies and consolidates as
    before. Then the same overwrite, unhindered, replaces it whole: the new world, nothing of the old left."""
    c = s3_server.client()
    url = f"s3://ckpts/ow-{to}"
    assert _cli("reshard", SRC, url, "--world", "2", "--to", to)[0] == 0
    before = _objects(c, f"ow-{to}")
    want = _model(url, tmp_path, "before")
    relay.refuse = lambda m, p: (
        m == "PUT" and p.split("?")[0].endswith(f"/{completing}") and f"/ow-{to}/" in p
    )
    code, out = _cli("reshard", SRC, url, "--world", "3", "--to", to, "--overwrite")
    assert code == 2 and "access denied" in out, out
    relay.refuse = None
    assert _objects(c, f"ow-{to}") == before
    assert _cli("verify", url)[0] == 0
    assert _model(url, tmp_path, "after-failure") == want
    code, out = _cli("reshard", SRC, url, "--world", "3", "--to", to, "--overwrite")
    assert code == 0, out
    now = _objects(c, f"ow-{to}")
    assert not set(now) & {k for k in before if "rank_" in k or ".distcp" in k}  # the old data is gone
    code, out = _cli("verify", url)
    assert code == 0, out
    assert len([k for k in now if k.endswith((".distcp", ".safetensors"))]) == 3  # one data file a rank
    assert _model(url, tmp_path, "replaced") == want  # the same model, at world 3


@pytest.mark.parametrize(
    "args",
    [
        ("reshard", "--world", "3", "--to", "deepspeed"),
        ("consolidate", "--max-shard-size", "600B"),
    ],
)
def test_overwrite_of_fixed_names_is_refused_in_one_line(
    args: tuple[str, ...], relay: _s3.FaultProxy, s3_server: _s3.Server
) -> None:
    """Outputs whose data files have fixed names (DeepSpeed's layout, a sharded HF folder) cannot replace
    an earlier one in a bucket without a window where neither is whole: refused, nothing touched."""
    c = s3_server.client()
    cmd, *rest = args
    url = f"s3://ckpts/fixed-{cmd}"
    first = [cmd, SRC, url, *rest]
    if cmd == "reshard":
        first[first.index("3")] = "2"
    assert _cli(*first)[0] == 0
    before = _objects(c, f"fixed-{cmd}")
    code, out = _cli(cmd, SRC, url, *rest, "--overwrite")
    lines = out.strip().splitlines()
    assert code == 2 and lines[0].startswith("error: ") and "neither" in lines[0], out
    assert lines[-1] == "hint: write to a new prefix, then delete the old one", out
    assert _objects(c, f"fixed-{cmd}") == before


def test_failed_overwrite_of_one_file_keeps_it_and_its_sidecar(
    relay: _s3.FaultProxy, s3_server: _s3.Server, tmp_path: Path
) -> None:
    """``consolidate --overwrite`` of one model file whose upload fails: the previous file and its sidecar
    are in place, verified clean (the sidecar was taken away while the new file uploaded, and put back)."""
    c = s3_server.client()
    url = "s3://ckpts/one/model.safetensors"
    assert _cli("consolidate", SRC, url, "--dtype", "fp32")[0] == 0
    before = _objects(c, "one")
    assert set(before) == {"one/model.safetensors", "one/model.safetensors.crc32.json"}
    relay.refuse = lambda m, p: m in ("PUT", "POST") and p.split("?")[0].endswith("/one/model.safetensors")
    code, out = _cli("consolidate", SRC, url, "--dtype", "bf16", "--overwrite")
    assert code == 2, out
    relay.refuse = None
    assert _objects(c, "one") == before
    assert _cli("verify", url)[0] == 0


def _sigint_default() -> None:
    """In the child: SIGINT at its default, so Python installs its handler even where the test runs under a
    parent that ignores SIGINT (CI started as a background job of a non-interactive shell)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.serial  # the interrupt must reach the command before the held request is released
@pytest.mark.parametrize("lands", [False, True], ids=["dropped", "lands-late"])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_interrupted_reshard_to_the_bucket_says_what_it_left(
    nth: int, lands: bool, relay: _s3.FaultProxy, s3_server: _s3.Server, tmp_path: Path
) -> None:
    """Ctrl-C while ``reshard ... s3://.../out --world 3`` uploads its rank files (held at the ``nth``
    rank file's upload, then dropped, or relayed late: a request that had left when the interrupt came and
    lands after the command gave its output up): exit 130; when the command says "no partial output was
    left behind" the bucket holds nothing under the output, and the same command then runs (not "already
    exists"). Before: a rank file whose upload landed late stayed, and the rerun was refused."""
    name = f"int-{nth}-{int(lands)}"
    url = f"s3://ckpts/{name}/out"
    seen: list[str] = []

    def hold(m: str, p: str) -> bool:
        path = p.split("?")[0]
        if m == "PUT" and "/rank_" in path and path not in seen:
            seen.append(path)
        return m == "PUT" and len(seen) >= nth and path == seen[nth - 1]

    relay.hold = hold
    relay.forward_held = lands
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "zckpt", "reshard", str(SRC), url, "--world", "3", "--to", "native"]
    p = subprocess.Popen(  # noqa: S603
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, preexec_fn=_sigint_default
    )
    if not relay.held.wait(120):
        p.kill()
        out = p.communicate()[0].decode()[-2000:]
        raise AssertionError(f"the upload never reached the held request: {out}")
    p.send_signal(signal.SIGINT)
    # The interrupt first, then the held request: released at once, on a loaded machine the request could
    # fail or land before the command ran its handler (then it rightly reports the store's error, or a
    # whole output), which is another case than the one this test names.
    time.sleep(1.0)
    relay.release.set()
    out, _ = p.communicate(timeout=120)
    text = out.decode()
    relay.hold = None
    assert p.returncode == 130, text
    left = _s3.keys(s3_server.client(), "ckpts", f"{name}/")
    if "no partial output was left behind" in text:
        assert left == [], (left, text)
    else:
        assert "could not be deleted" in text and all(k.split("/", 1)[1] in text for k in left[:3]), text
    code, again = _cli("reshard", SRC, url, "--world", "3", "--to", "native")
    assert code == 0, again
