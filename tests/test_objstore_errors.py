"""Errors from the store in one true line, and retries only where they can help (issue 38, item 4).

Faults come from outside the process under test: a closed port, a local server that never answers, and a
relay in front of the moto server that answers chosen requests with an S3 error before forwarding the
rest. Counts are the relay's own (what reached the store), never zckpt's. The no-credentials case runs the
CLI in a subprocess whose environment has no ``AWS_EC2_METADATA_DISABLED`` and whose instance-metadata
address is a local one: nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import http.client
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import _s3
import pytest
from _fixtures import fixture
from typer.testing import CliRunner

from zckpt.cli.app import app

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1", "ZCKPT_DEBUG": ""})
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Relay:
    """An HTTP relay to the S3 server: a request that ``fails(method, path)`` accepts is answered with
    ``status`` and an S3 error document of ``code`` (while ``times`` lasts, if set); the others are
    forwarded. ``log`` holds ``(method, path, status)`` of every request, in order."""

    target: str
    fails: Callable[[str, str], bool]
    status: int
    code: str
    times: int | None = None
    log: list[tuple[str, str, int]] = field(default_factory=list)
    url: str = ""

    def __post_init__(self) -> None:
        host, port = self.target.removeprefix("http://").split(":")
        relay, lock = self, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                with lock:
                    fail = relay.fails(self.command, self.path) and (relay.times is None or relay.times > 0)
                    if fail and relay.times is not None:
                        relay.times -= 1
                if fail:
                    with lock:  # logged before the client can see the answer
                        relay.log.append((self.command, self.path, relay.status))
                    msg = f"<Error><Code>{relay.code}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(relay.status)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                hdrs = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=hdrs)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)) if self.command != "HEAD" else
                                 resp.getheader("Content-Length") or "0")  # fmt: skip
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()
                with lock:
                    relay.log.append((self.command, self.path, resp.status))

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def failed(self) -> list[tuple[str, str]]:
        return [(m, p) for m, p, s in self.log if s == self.status]

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture(scope="module")
def uploaded(s3_server: _s3.Server) -> tuple[Path, str]:
    """A real DCP checkpoint (torch's own ``dcp.save`` of an FSDP2 run), local and in the bucket."""
    lp = fixture("dcp", "fsdp2_w2", "checkpoint")
    return lp, _s3.upload(s3_server.client(), lp, "ckpts", "errs/checkpoint-500")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Point the client at an endpoint with the test keys (the user's environment only)."""

    def point(endpoint: str) -> None:
        for k, v in _s3.env_for(endpoint):
            monkeypatch.setenv(k, v)

    yield point


def _cli(*args: str) -> tuple[int, float, list[str]]:
    """Exit code, seconds, output lines of one command (run once before on a missing local path, so the
    seconds count the store's part, not the first import of torch)."""
    if not _WARM:
        runner.invoke(app, ["inspect", "/nonexistent/zckpt-warm-up"])
        _WARM.append(True)
    t = time.monotonic()
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, time.monotonic() - t, r.output.strip().splitlines()


_WARM: list[bool] = []


def _one_line(code: int, lines: list[str]) -> str:
    """The error line of a failed command that printed one error line and one hint, nothing else."""
    assert code == 2 and len(lines) == 2, lines
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: "), lines
    return lines[0].removeprefix("error: ")


def _named(line: str) -> str:
    """The line without the URL it starts with (the bucket's or the key's: whichever request met it)."""
    where, sep, what = line.partition(": ")
    assert sep and where in ("s3://ckpts", "s3://ckpts/x"), line
    return what


def test_a_key_naming_500_with_a_final_error_is_asked_once(
    s3_server: _s3.Server, uploaded: tuple[Path, str], env: Callable[..., None]
) -> None:
    """A 400 InvalidArgument on every request under ``checkpoint-500/``: the command fails at once, each
    request reached the store once (it was retried 6 times because the text held "500", "timeout")."""
    _, url = uploaded
    relay = Relay(s3_server.url, lambda m, p: "checkpoint-500" in p, 400, "InvalidArgument")
    try:
        env(relay.url)
        code, took, lines = _cli("inspect", url)
        assert relay.failed(), relay.log
        assert max(Counter(relay.failed()).values()) == 1, relay.log
        line = _one_line(code, lines)
        assert line.startswith(f"{url}: the store answered HTTP 400 InvalidArgument"), lines
    finally:
        relay.stop()


def test_closed_port_is_connection_refused_at_once(env: Callable[..., None]) -> None:
    port = _s3.free_port()
    env(f"http://127.0.0.1:{port}")
    code, took, lines = _cli("inspect", "s3://ckpts/x")
    assert _named(_one_line(code, lines)) == f"connection refused by 127.0.0.1:{port}", lines
    assert took < 3.0, took


def test_unanswered_connect_is_a_timeout_named_as_such(env: Callable[..., None]) -> None:
    """A listening port whose accept queue is full leaves the connect unanswered: it times out (1 s, the
    ``connect_timeout`` given), said as a timeout naming the address, without the client's retries on top."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(0)
    port = srv.getsockname()[1]
    held = []
    for _ in range(64):  # fill the accept queue (never accepted) until a connect is left unanswered
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        held.append(c)
        _, done, _ = select.select([], [c], [], 0.3)
        if not done:  # its SYN was dropped: the queue is full, so the CLI's will be too
            break
    else:
        pytest.fail("the accept queue never filled: every connect was answered")
    try:
        env(f"http://127.0.0.1:{port}")
        code, took, lines = _cli("inspect", "s3://ckpts/x", "--storage-option", "connect_timeout=1")
        line = _one_line(code, lines)
        # Linux may still answer a SYN to a full accept queue (it drops the handshake's last ACK instead):
        # the client then believes it connected and times out waiting (fresh-clone CI saw it at 7633b08)
        assert _named(line) in (f"timed out after 1.0 s connecting to 127.0.0.1:{port}",
                                f"timed out after 1.0 s waiting for 127.0.0.1:{port}"), lines  # fmt: skip
        assert took < 3.0, took
    finally:
        for c in held:
            c.close()
        srv.close()


def _bare_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A user's environment with no AWS variable at all (no ``AWS_EC2_METADATA_DISABLED``): an empty HOME;
    ``extra`` added."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "SYSTEMROOT") if k in os.environ}
    return {**keep, "HOME": str(home), "PYTHONPATH": str(ROOT), "COLUMNS": "200", "NO_COLOR": "1", **extra}


def _silent_server() -> socket.socket:
    """A port that accepts connections and never answers (an instance-metadata service that hangs)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conns.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv


_CHILD = """
import sys, time
from zckpt.cli.app import app
def run(args):
    try:
        app(args)
    except SystemExit as e:
        return e.code
run(["inspect", "/nonexistent/zckpt-warm-up"])  # the imports (torch) are not the store's time
t = time.monotonic()
code = run(sys.argv[1:])
print(f"took {time.monotonic() - t:.3f}", file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.parametrize("imds", ["closed", "silent", "endpoint"])
def test_no_credentials_is_one_line_without_any_switch(
    imds: str, s3_server: _s3.Server, tmp_path: Path
) -> None:
    """No key, no profile, no switch: the documented line within 2 s. The metadata service is a closed
    local port, or a local server that never answers (the probe gives up after 1 s), or not asked because
    an endpoint is configured (a custom endpoint is never EC2's S3)."""
    silent = _silent_server() if imds == "silent" else None
    address = f"http://127.0.0.1:{silent.getsockname()[1] if silent else _s3.free_port()}"
    extra = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": address, "AWS_METADATA_ENDPOINT": address}
    if imds == "endpoint":
        extra["AWS_ENDPOINT_URL"] = s3_server.url
    argv = [sys.executable, "-c", _CHILD, "inspect", "s3://ckpts/x"]
    try:
        r = subprocess.run(
            argv, env=_bare_env(tmp_path, **extra), capture_output=True, text=True, timeout=120
        )
    finally:
        if silent is not None:
            silent.close()
    *lines, took = [x for x in (r.stdout + r.stderr).strip().splitlines() if "zckpt-warm-up" not in x]
    assert r.returncode == 2 and lines[0].startswith("error: "), lines
    assert _named(lines[0].removeprefix("error: ")) == "no credentials for the store", lines
    assert len(lines) == 2 and lines[1].startswith("hint: set AWS_ACCESS_KEY_ID"), lines
    assert float(took.removeprefix("took ")) < 2.0, took


def test_transient_503_is_retried_within_max_retries_and_403_is_not(
    s3_server: _s3.Server, uploaded: tuple[Path, str], env: Callable[..., None]
) -> None:
    """503 SlowDown on the first GETs: within ``max_retries`` (2) the command succeeds and prints what the
    local run prints; one more than that and it fails after exactly 3 tries of the request (zckpt's own
    retries used to stack 6 rounds on the client's). A 403 AccessDenied is final: asked once."""
    lp, url = uploaded
    local = runner.invoke(app, ["inspect", str(lp)])
    assert local.exit_code == 0, local.output
    for fails, ok in ((2, True), (3, False)):
        relay = Relay(s3_server.url, lambda m, p: m == "GET", 503, "SlowDown", times=fails)
        try:
            env(relay.url)
            code, _, lines = _cli("inspect", url, "--storage-option", "max_retries=2")
            assert len(relay.failed()) == fails, relay.log
            if ok:
                assert code == 0 and "\n".join(lines).replace(url, str(lp)) == local.output.strip(), lines
            else:
                line = _one_line(code, lines)
                assert line.startswith("s3://ckpts/errs"), line  # the folder listed, or the record read
                assert line.endswith(": the store answered HTTP 503 SlowDown after 2 retries"), line
                assert len(set(relay.failed())) == 1, relay.log  # one request, tried 3 times
        finally:
            relay.stop()
    relay = Relay(s3_server.url, lambda m, p: m == "GET", 403, "AccessDenied")
    try:
        env(relay.url)
        code, _, lines = _cli("inspect", url)
        line = _one_line(code, lines)
        assert line.startswith("s3://ckpts/errs") and line.endswith(": access denied"), lines
        assert len(relay.failed()) == 1, relay.log
    finally:
        relay.stop()


def test_https_to_a_plain_http_store_is_a_tls_failure(
    s3_server: _s3.Server, env: Callable[..., None]
) -> None:
    """``https://`` to the (plain http) moto server: the handshake fails, said as such, at once."""
    port = s3_server.url.rsplit(":", 1)[1]
    env(f"https://127.0.0.1:{port}")
    code, took, lines = _cli("inspect", "s3://ckpts/x")
    assert _named(_one_line(code, lines)) == f"TLS handshake with 127.0.0.1:{port} failed", lines
    assert took < 3.0, took


# obstore 0.12.1's error for ``obstore.get`` of ``checkpoint-500/x`` on ``http://nonexistent.invalid:9000``
# (recorded: a test does not look a name up outside 127.0.0.1). Oracle for the one case not run live.
_DNS_FAILURE = """Generic S3 error: Error performing GET \
http://nonexistent.invalid:9000/bkt/checkpoint-500/x in 173.691912ms, after 2 retries, max_retries: 2, \
retry_timeout: 5s  - HTTP error: error sending request

Debug source:
Generic {
    store: "S3",
    source: RetryError(
        RetryErrorImpl {
            method: GET,
            uri: Some(
                http://nonexistent.invalid:9000/bkt/checkpoint-500/x,
            ),
            retries: 2,
            max_retries: 2,
            elapsed: 173.691912ms,
            retry_timeout: 5s,
            inner: Http(
                HttpError {
                    kind: Connect,
                    source: reqwest::Error {
                        kind: Request,
                        source: hyper_util::client::legacy::Error(
                            Connect,
                            ConnectError(
                                "dns error",
                                Custom {
                                    kind: Uncategorized,
                                    error: "failed to lookup address information: Name or service not known",
                                },
                            ),
                        ),
                    },
                },
            ),
        },
    ),
}"""


def test_unknown_host_is_named_from_the_error_chain() -> None:
    from obstore.exceptions import GenericError

    from zckpt.storage.objstore import failures

    e = GenericError(_DNS_FAILURE)  # "500" in the key, "timeout" in the retry fields: neither is read
    f = failures.classify(e)
    assert (f.kind, f.retries, f.connect_phase, f.transient) == (failures.Kind.DNS, 2, True, False)
    line = failures.one_line(e, "s3://bkt/checkpoint-500/x")
    assert str(line) == "s3://bkt/checkpoint-500/x: cannot resolve host nonexistent.invalid"
