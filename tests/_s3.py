"""A real S3 server for the tests: moto's ``ThreadedMotoServer`` on 127.0.0.1 (a free port), and a
fault-injecting HTTP proxy to put in front of it.

Nothing is patched in-process: zckpt's client speaks HTTP to the server (or the proxy), configured only by
the environment a user sets for an S3-compatible store (``AWS_ENDPOINT_URL`` & co.). No test sends traffic
anywhere but 127.0.0.1; ``AWS_EC2_METADATA_DISABLED`` keeps every credential chain off instance metadata.
"""

from __future__ import annotations

import http.client
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

CREDS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A running moto S3 server: its endpoint and a boto3 client for the tests' own setup and checks."""

    url: str
    _srv: object

    def client(self) -> object:
        import boto3

        return boto3.client("s3", endpoint_url=self.url, **_boto_creds())

    def stop(self) -> None:
        self._srv.stop()  # type: ignore[attr-defined]


def _boto_creds() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDS["AWS_SECRET_ACCESS_KEY"],
        "region_name": CREDS["AWS_DEFAULT_REGION"],
    }


def start() -> Server:
    from moto.server import ThreadedMotoServer

    port = free_port()
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    srv.start()
    return Server(f"http://127.0.0.1:{port}", srv)


_CHILD_SERVER = """
import os, sys
if len(sys.argv) > 2:  # IAM: the first N requests go unchecked (the tests' setup calls), then every one is
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = sys.argv[2]
from moto.server import ThreadedMotoServer
s = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
s.start()
print("ready", flush=True)
sys.stdin.read()
s.stop()
"""


def _spawn(*args: str, quiet: bool = True) -> tuple[int, subprocess.Popen[bytes]]:
    """A moto server in a child process on a free port (``_CHILD_SERVER``), once it answers."""
    port = free_port()
    env = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true"}
    argv = [sys.executable, "-c", _CHILD_SERVER, str(port), *args]
    err = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return port, proc


@dataclass
class ChildServer(Server):
    """A moto server in a process of its own (the benchmark's: its work does not share this process's GIL
    with the client's side, as a real store would not)."""

    _proc: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


def start_child() -> ChildServer:
    port, proc = _spawn()
    return ChildServer(f"http://127.0.0.1:{port}", None, proc)


@dataclass
class AuthServer:
    """A second moto server, in its own process, that checks credentials (IAM): bucket ``authb`` holds
    ``x/latest``; ``key`` is an IAM user's key with no permission at all."""

    url: str
    key: tuple[str, str]
    _proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


def start_authenticating() -> AuthServer:
    import boto3

    port, proc = _spawn("4", quiet=False)  # the 4 setup calls below, then every request is checked
    url = f"http://127.0.0.1:{port}"
    kw = {"endpoint_url": url, **_boto_creds()}
    s3, iam = boto3.client("s3", **kw), boto3.client("iam", **kw)
    s3.create_bucket(Bucket="authb")
    s3.put_object(Bucket="authb", Key="x/latest", Body=b"global_step1")
    iam.create_user(UserName="reader")
    k = iam.create_access_key(UserName="reader")["AccessKey"]
    return AuthServer(url, (k["AccessKeyId"], k["SecretAccessKey"]), proc)


def upload(client: object, folder: Path, bucket: str, prefix: str) -> str:
    """Every file under ``folder`` to ``s3://bucket/prefix/...``; returns that URL."""
    for root, _, files in os.walk(folder):
        for f in files:
            p = Path(root) / f
            client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(folder)}")  # type: ignore[attr-defined]
    return f"s3://{bucket}/{prefix}"


def keys(client: object, bucket: str, prefix: str = "") -> list[str]:
    out: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):  # type: ignore[attr-defined]
        out += [o["Key"] for o in page.get("Contents", [])]
    return sorted(out)


@dataclass
class FaultProxy:
    """An HTTP proxy to the server that answers 503 SlowDown or drops the connection (before the response,
    or after half of its body) at random, with a seeded RNG; counts what passed through."""

    target: str
    seed: int = 0
    p503: float = 0.1
    pdrop: float = 0.05
    ptrunc: float = 0.05
    rate: float = 0.0
    """Bytes per second of all response bodies together (0: unlimited): a network link to the store."""
    counts: dict[str, int] = field(default_factory=lambda: {"requests": 0, "faults": 0, "bytes": 0})
    log: list[tuple[str, str]] = field(default_factory=list)
    """(method, path) of every request answered with success, in the order the answers went out."""
    refuse: Callable[[str, str], bool] | None = None
    """(method, path) -> answer 403 AccessDenied instead of relaying (a deterministic, non-retried failure
    of chosen requests); the refusals are counted in ``counts["refused"]``."""
    hold: Callable[[str, str], bool] | None = None
    """(method, path) -> keep the request waiting (``held`` is set when one arrives) until ``release`` is
    set, then drop its connection without relaying it: the client was killed before the request left."""
    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        lock = threading.Lock()
        host, port = self.target.removeprefix("http://").split(":")
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def _any(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                if proxy.hold is not None and proxy.hold(self.command, self.path):
                    proxy.held.set()
                    proxy.release.wait(120)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if proxy.refuse is not None and proxy.refuse(self.command, self.path):
                    with lock:
                        proxy.counts["refused"] = proxy.counts.get("refused", 0) + 1
                    msg = b"<Error><Code>AccessDenied</Code><Message>refused by the test</Message></Error>"
                    self.send_response(403)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                with lock:
                    r = rng.random()
                    proxy.counts["requests"] += 1
                fault = "503" if r < proxy.p503 else "drop" if r < proxy.p503 + proxy.pdrop else None
                if fault is None and self.command == "GET" and r < proxy.p503 + proxy.pdrop + proxy.ptrunc:
                    fault = "trunc"
                if fault == "503":
                    with lock:
                        proxy.counts["faults"] += 1
                    msg = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                if fault == "drop":
                    with lock:
                        proxy.counts["faults"] += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                conn = http.client.HTTPConnection(host, int(port), timeout=60)
                hdrs = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=hdrs)
                resp = conn.getresponse()
                head = self.command == "HEAD"
                length = None if head else resp.getheader("Content-Length")
                if not head and length is None:  # chunked upstream: relay it whole
                    data: bytes | None = resp.read()
                    length = str(len(data))
                else:
                    data = None
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    low = k.lower()
                    if low not in ("transfer-encoding", "connection") and (head or low != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(length))
                self.end_headers()
                n = 0 if head else int(str(length))
                cut = n // 2 if fault == "trunc" and n > 16 else None
                sent = proxy._relay(self.wfile, resp, data, n if cut is None else cut)
                conn.close()
                if cut is not None:
                    with lock:
                        proxy.counts["faults"] += 1
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                with lock:
                    proxy.counts["bytes"] += sent if self.command == "GET" else 0
                    if resp.status < 300:
                        proxy.log.append((self.command, self.path))

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    _link = threading.Lock()
    _free_at = 0.0

    def _relay(self, out: object, resp: http.client.HTTPResponse, data: bytes | None, n: int) -> int:
        """Relay ``n`` bytes of the upstream body to ``out`` as they arrive (1 MiB at a time: the client sees
        the first bytes before the server has sent the last, as through a real link); with a ``rate``, each
        piece once the link has carried the bytes before it. Returns the bytes relayed (a client that hangs
        up stops the relay: only what it received counts)."""
        sent = 0
        while sent < n:
            k = min(1 << 20, n - sent)
            part = data[sent : sent + k] if data is not None else resp.read(k)
            if not part:
                break
            if self.rate > 0:
                with self._link:
                    start = max(time.monotonic(), self._free_at)
                    self._free_at = start + len(part) / self.rate
                time.sleep(max(0.0, self._free_at - time.monotonic()))
            try:
                out.write(part)  # type: ignore[attr-defined]
            except OSError:
                break
            sent += len(part)
        return sent

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def env_for(url: str) -> Iterator[tuple[str, str]]:
    """The environment a user sets for an S3-compatible store at ``url``: nothing zckpt-specific."""
    yield "AWS_ENDPOINT_URL", url
    yield from CREDS.items()
