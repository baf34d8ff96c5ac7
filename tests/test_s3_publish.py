"""Issue 38: a save into a bucket never makes the previous good state unloadable, whatever fails or stops it.

The engine saves tag ``t`` into ``s3://ckpts/...`` through a relay (``_s3.FaultProxy``) in front of a real
S3 server; the relay refuses chosen requests (403, not retried) or holds one until the saving process is
killed. After each failure the bucket is read back through the public API only: ``zckpt verify`` is clean,
and a fresh engine's ``load_checkpoint`` resumes exactly as one resumed from a local copy of the save that
should have survived (the oracle: that local save, made from the same state).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import _engine_ref as R
import _s3
import pytest
from typer.testing import CliRunner

from zckpt.cli.app import app
from zckpt.errors import ZckptError

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})


def _keys(c: Any, prefix: str) -> list[str]:
    return [k[len(prefix) + 1 :] for k in _s3.keys(c, "ckpts", prefix + "/")]


def _resume(cfg: dict[str, Any], where: str, tag: str | None = None) -> list[float]:
    eng, _ = R.train(0, 1, cfg, 0)
    path, _ = eng.load_checkpoint(where, tag=tag)
    assert path is not None
    _, losses = R.train(0, 1, cfg, 2, first=int(eng.global_steps), engine_=eng)
    eng.destroy()
    return losses


def _verify(url: str) -> tuple[int, str]:
    r = runner.invoke(app, ["verify", url])
    return r.exit_code, r.output


def _is(method: str, path: str, want: str, part: str) -> bool:
    return method == want and part in path.split("?")[0]


@pytest.mark.parametrize("fails", ["manifest", "rank file"])
def test_failed_resave_keeps_the_previous_save(
    fails: str, relay: _s3.FaultProxy, s3_server: _s3.Server, tmp_path: Path
) -> None:
    """Save ``t``, train on, save ``t`` again and fail that save while publishing (its manifest refused) or
    while writing (its rank file refused): ``t`` is still the first save, whole; the failed save's objects
    are gone."""
    cfg = R.config(3)
    url = f"s3://ckpts/resave-{fails.replace(' ', '')}"
    eng, _ = R.train(0, 1, cfg, 3)
    eng.save_checkpoint(str(tmp_path / "local"), tag="t")
    eng.save_checkpoint(url, tag="t")
    prefix = url.removeprefix("s3://ckpts/")
    first = _keys(s3_server.client(), prefix)
    R.train(0, 1, cfg, 2, first=3, engine_=eng)
    part = "/t/manifest.json" if fails == "manifest" else "/t/rank_"
    relay.refuse = lambda m, p: _is(m, p, "PUT", part)
    with pytest.raises(ZckptError, match="access denied"):  # rank 0's own error: the refused request
        eng.save_checkpoint(url, tag="t")
    relay.refuse = None
    eng.destroy()
    assert _keys(s3_server.client(), prefix) == first  # nothing of the failed save is left
    code, out = _verify(url)
    assert code == 0, out
    assert _resume(cfg, url) == _resume(cfg, str(tmp_path / "local"))


def test_new_tag_whose_latest_fails_is_whole_and_said_so(
    relay: _s3.FaultProxy, s3_server: _s3.Server, tmp_path: Path
) -> None:
    """A new tag ``t2`` whose ``latest`` cannot be written: the error says ``t2`` was published whole and
    ``latest`` still names ``t``; both tags load, ``latest`` gives ``t``."""
    cfg = R.config(3)
    url = "s3://ckpts/newtag"
    eng, _ = R.train(0, 1, cfg, 3)
    eng.save_checkpoint(str(tmp_path / "local"), tag="t")
    eng.save_checkpoint(url, tag="t")
    R.train(0, 1, cfg, 2, first=3, engine_=eng)
    eng.save_checkpoint(str(tmp_path / "local"), tag="t2")
    relay.refuse = lambda m, p: _is(m, p, "PUT", "/newtag/latest")
    with pytest.raises(Exception, match="published whole") as e:
        eng.save_checkpoint(url, tag="t2")
    assert "`latest` still names the previous tag" in str(e.value)
    relay.refuse = None
    eng.destroy()
    assert _verify(url)[0] == 0 and _verify(f"{url}/t2")[0] == 0
    assert _resume(cfg, url) == _resume(cfg, str(tmp_path / "local"), "t")
    assert _resume(cfg, url, "t2") == _resume(cfg, str(tmp_path / "local"), "t2")


def test_resave_replaces_the_previous_generation(
    relay: _s3.FaultProxy, s3_server: _s3.Server, tmp_path: Path
) -> None:
    """A re-save that succeeds replaces ``t`` whole: the manifest names the new generation, the previous
    generation's objects are gone, and a leftover of a killed save is deleted with a warning."""
    cfg = R.config(3)
    url = "s3://ckpts/regen"
    eng, _ = R.train(0, 1, cfg, 3)
    eng.save_checkpoint(url, tag="t")
    c = s3_server.client()
    c.put_object(Bucket="ckpts", Key="regen/t/rank_00000.g0000000000000000.safetensors", Body=b"x")  # type: ignore[attr-defined]
    R.train(0, 1, cfg, 2, first=3, engine_=eng)
    eng.save_checkpoint(str(tmp_path / "local"), tag="t")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng.save_checkpoint(url, tag="t")
    eng.destroy()
    assert any("unfinished earlier save" in str(w.message) for w in caught), [str(w.message) for w in caught]
    gen = json.loads(c.get_object(Bucket="ckpts", Key="regen/t/manifest.json")["Body"].read())["generation"]  # type: ignore[attr-defined]
    assert _keys(c, "regen") == ["latest", "t/manifest.json", f"t/rank_00000.{gen}.safetensors"]
    assert _resume(cfg, url) == _resume(cfg, str(tmp_path / "local"))


_SAVER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import _engine_ref as R
    cfg = R.config(3)
    eng, _ = R.train(0, 1, cfg, 3)
    eng.save_checkpoint({url!r}, tag="t")
    R.train(0, 1, cfg, 2, first=3, engine_=eng)
    print("first", flush=True)
    sys.stdin.readline()  # the relay is set to hold the chosen request
    eng.save_checkpoint({url!r}, tag="t")
    print("second", flush=True)
    """
)


@pytest.mark.parametrize(
    ("point", "how"),
    [
        ("rank file", signal.SIGKILL),
        ("manifest", signal.SIGKILL),
        ("latest", signal.SIGKILL),
        ("delete", signal.SIGKILL),
        ("rank file", signal.SIGINT),
        ("manifest", signal.SIGTERM),
    ],
)
def test_killed_resave_leaves_a_whole_save(
    point: str, how: signal.Signals, relay: _s3.FaultProxy, s3_server: _s3.Server, tmp_path: Path
) -> None:
    """A training process killed (SIGKILL, Ctrl-C, SIGTERM) while re-saving ``t`` at four points of the
    upload (its rank file, the manifest, ``latest``, the deletion of the previous generation): the bucket
    always holds one whole save that verifies clean and loads; the next save of ``t`` cleans what the killed
    one left."""
    name = f"kill-{point.replace(' ', '')}-{int(how)}"
    url = f"s3://ckpts/{name}"
    parts = {
        "rank file": ("PUT", f"{name}/t/rank_"),
        "manifest": ("PUT", f"{name}/t/manifest.json"),
        "latest": ("PUT", f"{name}/latest"),
        "delete": ("POST", "/ckpts"),  # the multi-object delete of the previous generation
    }
    method, part = parts[point]
    seen = {"first": False}

    def hold(m: str, p: str) -> bool:
        if not seen["first"]:
            return False
        return m == method and (part in p.split("?")[0]) and (point != "delete" or "delete" in p)

    relay.hold = hold
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")]))
    script = _SAVER.format(tests=str(Path(__file__).parent), url=url)
    p = subprocess.Popen(  # noqa: S603
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert p.stdout is not None and p.stdin is not None
    assert p.stdout.readline().strip() == b"first"
    seen["first"] = True
    p.stdin.write(b"go\n")
    p.stdin.flush()
    assert relay.held.wait(60), f"the re-save never reached its {point}"
    p.send_signal(how)
    relay.release.set()  # the held request is dropped, never relayed: it had not left the killed process
    p.wait(60)
    relay.hold = None
    code, out = _verify(url)
    assert code == 0, out
    cfg = R.config(3)
    _resume(cfg, url)  # loads whichever save the manifest names
    eng, _ = R.train(0, 1, cfg, 3)  # the next save of the tag: whole, the killed save's objects gone
    eng.save_checkpoint(url, tag="t")
    eng.destroy()
    c = s3_server.client()
    gen = json.loads(c.get_object(Bucket="ckpts", Key=f"{name}/t/manifest.json")["Body"].read())["generation"]  # type: ignore[attr-defined]
    assert _keys(c, name) == ["latest", "t/manifest.json", f"t/rank_00000.{gen}.safetensors"]
