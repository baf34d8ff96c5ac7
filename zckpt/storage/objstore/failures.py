"""What went wrong in a call to the store, as one ``Kind``, and the one line a user reads about it.

obstore (Rust's ``object_store`` underneath) raises a few exception types (``FileNotFoundError``,
``AlreadyExistsError``, ``PermissionDeniedError``, ``UnauthenticatedError``, ``GenericError``...) and sets no
``__cause__``: what else it knows travels in the message, after ``Debug source:``, as the Rust error chain
in its pretty ``Debug`` form, one field per line::

    RetryError(RetryErrorImpl { method: GET, uri: Some(http://...), retries: 10, elapsed: 1.48s,
        inner: Http(HttpError { kind: Connect, source: ... Os { kind: ConnectionRefused, ... } }) })
    RetryError(RetryErrorImpl { ..., inner: Status { status: 503, body: Some("<Error><Code>SlowDown...") } })

``classify`` reads, in this order: the exception's type; the chain's fields (the HTTP ``status``, the S3
error ``<Code>`` of the response body, ``HttpError``'s ``kind``, the I/O error's ``kind``, ``retries``,
``elapsed``) and its variant names (``ConnectError``, ``ListResponseBody``, ``BadScheme``...). It never
reads the message's first line, the ``uri`` or the ``path``: those hold the URL and the key, whose text
(``checkpoint-500/...``) says nothing about the failure. The one string matched is hyper's documented
``ConnectError("dns error")`` label. Python exceptions (an fsspec store) are classified by type along
their ``__cause__``/``__context__`` chain.

``one_line(e, url)`` is the ``StorageError`` a command prints; ``Failure.transient`` says whether waiting and
trying again could help; ``Failure.retry_here`` whether zckpt, not the client, should (see ``policy``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from urllib.parse import urlsplit

from zckpt.errors import ObjectMissing, StorageError


class Kind(Enum):
    NO_BUCKET = "no such bucket"
    NO_KEY = "no such key"
    ACCESS_DENIED = "access denied"
    BAD_CREDENTIALS = "the store rejected the credentials"
    NO_CREDENTIALS = "no credentials for the store"
    ALREADY_EXISTS = "already exists"
    CONNECTION_REFUSED = "connection refused"
    DNS = "cannot resolve host"
    TIMEOUT = "timed out"
    TLS = "TLS handshake failed"
    PLAIN_HTTP = "plain http refused"
    TRANSIENT = "transient failure"
    OTHER = "other"


_CONNECT_PHASE = frozenset({Kind.CONNECTION_REFUSED, Kind.DNS, Kind.TIMEOUT, Kind.TLS})
"""Failures before any byte of a request reached the store."""

_BAD_KEY_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)
"""S3 error codes that mean the credentials themselves were refused (not a missing permission)."""
_TRANSIENT_CODES = frozenset(
    {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "RequestTimeTooSkewed"}
)
_TRANSIENT_IO = frozenset(
    {"ConnectionReset", "ConnectionAborted", "BrokenPipe", "UnexpectedEof", "NotConnected"}
)
_TLS_VARIANTS = frozenset(
    {
        "InvalidCertificate",
        "InvalidMessage",
        "AlertReceived",
        "PeerIncompatible",
        "PeerMisbehaved",
        "NoCertificatesPresented",
        "HandshakeNotComplete",
    }
)
"""rustls error variants (a handshake that failed: wrong protocol, untrusted certificate)."""
_MISSING_KEY_VARIANTS = frozenset({"MissingAccessKeyId", "MissingSecretAccessKey"})


class ShortBody(OSError):
    """The store sent fewer bytes than the range asked for, with no error: the object is shorter than
    expected (it changed, or the reader's size is stale). Raised by the readers, not by the client."""


@dataclass(frozen=True)
class Failure:
    """One client error, classified."""

    kind: Kind
    status: int | None = None
    """The HTTP status the store answered, if it answered."""
    code: str | None = None
    """The S3 error code of the response body (``NoSuchKey``, ``SlowDown``, ``InvalidArgument``...)."""
    message: str | None = None
    """The S3 error message of the response body."""
    retries: int | None = None
    """Retries the client made before giving up (its ``RetryError``), if it retried at all."""
    elapsed_s: float | None = None
    """Seconds from the first attempt to the failure (its ``RetryError``)."""
    address: str | None = None
    """``host:port`` (or host) the client tried to reach."""
    variants: frozenset[str] = field(default=frozenset())
    """Names of the Rust error variants in the chain (``ListResponseBody``, ``ConnectError``...)."""

    @property
    def transient(self) -> bool:
        """Trying again later could succeed: a 5xx, SlowDown, a dropped connection, a body cut off."""
        return self.kind is Kind.TRANSIENT

    @property
    def connect_phase(self) -> bool:
        """The store was never reached: refused, unknown host, connect timeout, TLS handshake."""
        return self.kind in _CONNECT_PHASE

    @property
    def retry_here(self) -> bool:
        """A transient failure the client reports without retrying it: the body of a listing cut off
        mid-way (object_store reads it after its retry loop has returned: ``ListResponseBody``). Every
        other transient failure (5xx, SlowDown, dropped connections, a GET body cut off, which it resumes)
        the client has already retried within ``max_retries`` and ``retry_timeout``."""
        return self.transient and "ListResponseBody" in self.variants


# --- the Rust Debug chain -------------------------------------------------------------------------

_FIELD = re.compile(r"^([a-z_][a-z0-9_]*): (.*?),?$")
_STRING = re.compile(r'^"((?:[^"\\]|\\.)*)",?$')
_NAME = re.compile(r"^((?:[A-Za-z_][A-Za-z0-9_]*::)*[A-Za-z_][A-Za-z0-9_]*)(?: \{| ?\(|,|$)")
_DURATION = re.compile(r"^([0-9.]+)(s|ms|µs|us|ns)$")
_UNITS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6, "us": 1e-6, "ns": 1e-9}


@dataclass
class _Chain:
    """What the Debug form holds: ``(parent variant, field, value)`` triples (strings unquoted; an
    ``Option``'s value unwrapped), the variant names, and the unnamed items (strings, addresses) of each
    tuple variant as ``(variant, item)``."""

    fields: list[tuple[str, str, str]] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    items: list[tuple[str, str]] = field(default_factory=list)

    def first(self, name: str, parent: str | None = None) -> str | None:
        return next((v for p, f, v in self.fields if f == name and (parent is None or p == parent)), None)

    def values(self, name: str, parents: frozenset[str]) -> set[str]:
        return {v for p, f, v in self.fields if f == name and p in parents}


def _unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m.group(1), m.group(1)), s)


def _value(v: str) -> str:
    s = _STRING.match(v if v.endswith(",") else v + ",")
    return _unescape(s.group(1)) if s else v.rstrip(",")


def _chain(text: str) -> _Chain:
    """Parse the ``Debug source:`` section: one line per field, item or closing bracket. Strings never span
    lines (Debug escapes newlines); a URI or an address (unquoted) has no ``": "`` in it."""
    out = _Chain()
    _, sep, debug = text.partition("\nDebug source:\n")
    if not sep:
        return out
    stack: list[str] = []
    some_of: list[tuple[str, str]] = []  # (parent, field) of each open ``field: Some(``
    for raw in debug.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line[0] in "})]":
            if stack and stack.pop() == "Some" and some_of:
                some_of.pop()
            continue
        parent = stack[-1] if stack else ""
        m = _FIELD.match(line)
        name, value = (m.group(1), m.group(2)) if m else (None, line)
        opens = value.endswith(("{", "(", "["))
        n = _NAME.match(value)
        variant = (
            n.group(1).rsplit("::", 1)[-1] if n and not value.startswith(("http://", "https://")) else ""
        )
        if variant:
            out.names.add(variant)
        if name is not None and not opens:
            out.fields.append((parent, name, _value(value)))
        elif name is None and not opens:
            if parent == "Some" and some_of:
                out.fields.append((*some_of[-1], _value(value)))
            else:
                out.items.append((parent, _value(value)))
        if opens:
            if variant == "Some" and name is not None:
                some_of.append((parent, name))
            stack.append(variant)
    return out


def _seconds(s: str | None) -> float | None:
    m = _DURATION.match(s or "")
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


def _host(uri: str | None) -> str | None:
    """``host:port`` of a URI the client requested (shown in a line, never classified)."""
    return urlsplit(uri).netloc or None if uri else None


def _s3_error(body: str | None) -> tuple[str | None, str | None]:
    """The ``<Code>`` and ``<Message>`` of an S3 error document (the response body)."""
    if not body:
        return None, None
    code = re.search(r"<Code>([^<]*)</Code>", body)
    msg = re.search(r"<Message>([^<]*)</Message>", body)
    return (code.group(1) if code else None), (msg.group(1) if msg else None)


# --- classification -------------------------------------------------------------------------------


def _python_chain(e: BaseException) -> list[BaseException]:
    """``e`` and its causes, innermost last (an fsspec store chains the socket error it hit)."""
    seen: list[BaseException] = []
    x: BaseException | None = e
    while x is not None and x not in seen:
        seen.append(x)
        x = x.__cause__ or x.__context__
    return seen


def _by_python_type(e: BaseException) -> Kind | None:
    import socket  # here, not at import: a local command's start-up never classifies a store's error
    import ssl

    for x in reversed(_python_chain(e)):
        if isinstance(x, ConnectionRefusedError):
            return Kind.CONNECTION_REFUSED
        if isinstance(x, socket.gaierror):
            return Kind.DNS
        if isinstance(x, ssl.SSLError):
            return Kind.TLS
        if isinstance(x, TimeoutError):
            return Kind.TIMEOUT
        if isinstance(x, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
            return Kind.TRANSIENT
    return None


def _obstore_types() -> tuple[type, ...]:
    """obstore's ``(AlreadyExistsError, PermissionDeniedError, UnauthenticatedError, NotFoundError)``,
    or stand-ins when it is not installed (an fsspec store only)."""
    try:
        from obstore import exceptions as ox
    except ImportError:

        class _Absent(Exception): ...

        return (_Absent, _Absent, _Absent, _Absent)
    return (ox.AlreadyExistsError, ox.PermissionDeniedError, ox.UnauthenticatedError, ox.NotFoundError)


_DENIED_PREFIX = "The operation lacked the necessary privileges to complete for path "
_UNAUTH_PREFIX = "The operation lacked valid authentication credentials for path "
"""object_store's Display of ``Error::PermissionDenied`` / ``Error::Unauthenticated``, up to the path."""


def classify(e: BaseException) -> Failure:
    """The failure ``e`` (an exception the client raised) reports; see the module's docstring."""
    already, denied, unauth, missing = _obstore_types()
    c = _chain(str(e))
    status_s = c.first("status")
    status = int(status_s) if status_s and status_s.isdigit() else None
    code, message = _s3_error(c.first("body"))
    http_kind = c.first("kind", "HttpError")
    io_kinds = c.values("kind", frozenset({"Os", "Custom", "SimpleMessage"}))
    retries_s = c.first("retries")
    connect_items = [v for p, v in c.items if p == "ConnectError"]
    info = {
        "status": status,
        "code": code,
        "message": message,
        "retries": int(retries_s) if retries_s and retries_s.isdigit() else None,
        "elapsed_s": _seconds(c.first("elapsed")),
        "address": next((v for v in connect_items[1:] if ":" in v), None) or _host(c.first("uri")),
        "variants": frozenset(c.names),
    }

    def f(kind: Kind) -> Failure:
        return Failure(kind, **info)  # type: ignore[arg-type]

    # 1. the exception's type
    if isinstance(e, (FileNotFoundError, missing)):
        return f(Kind.NO_BUCKET if code == "NoSuchBucket" else Kind.NO_KEY)
    if isinstance(e, (FileExistsError, already)):
        return f(Kind.ALREADY_EXISTS)
    if isinstance(e, unauth):
        return f(Kind.BAD_CREDENTIALS)
    if isinstance(e, (PermissionError, denied)):
        return f(Kind.BAD_CREDENTIALS if code in _BAD_KEY_CODES else Kind.ACCESS_DENIED)
    if isinstance(e, ShortBody):
        return f(Kind.OTHER)
    # 1b. the same variants as a file-like writer raises them (an ``OSError`` carrying object_store's
    # Display text): matched at the start only, before the path, so no key can steer it
    head = str(e)
    if head.startswith(_DENIED_PREFIX):
        return f(Kind.ACCESS_DENIED)
    if head.startswith(_UNAUTH_PREFIX):
        return f(Kind.BAD_CREDENTIALS)
    # 2. what the store answered
    if status is not None:
        if status == 404:
            return f(Kind.NO_BUCKET if code == "NoSuchBucket" else Kind.NO_KEY)
        if code in _BAD_KEY_CODES or status == 401:
            return f(Kind.BAD_CREDENTIALS)
        if status == 403:
            return f(Kind.ACCESS_DENIED)
        if status >= 500 or status == 429 or code in _TRANSIENT_CODES:
            return f(Kind.TRANSIENT)
        return f(Kind.OTHER)
    # 3. no answer: how the request failed
    if c.names & _MISSING_KEY_VARIANTS:
        return f(Kind.NO_CREDENTIALS)
    if "BadScheme" in c.names:
        return f(Kind.PLAIN_HTTP)
    connect = http_kind == "Connect" or "ConnectError" in c.names
    if "ConnectionRefused" in io_kinds:
        return f(Kind.CONNECTION_REFUSED)
    if connect_items[:1] == ["dns error"]:  # hyper_util's label for a failed name lookup (ConnectError::new)
        return f(Kind.DNS)
    if http_kind == "Timeout" or "TimedOut" in io_kinds or "TimedOut" in c.names:
        return f(Kind.TIMEOUT)
    if connect and ("InvalidData" in io_kinds or c.names & _TLS_VARIANTS):
        return f(Kind.TLS)
    if http_kind in ("Interrupted", "Request") or io_kinds & _TRANSIENT_IO or "IncompleteMessage" in c.names:
        return f(Kind.TRANSIENT)
    by_type = _by_python_type(e)
    return f(by_type) if by_type is not None else f(Kind.OTHER)


# --- the line -------------------------------------------------------------------------------------

_ENDPOINT_HINT = "check the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint=...) and the network"
_HINTS = {
    Kind.NO_BUCKET: "check the bucket name and the endpoint (AWS_ENDPOINT_URL)",
    Kind.NO_KEY: "check the URL: list the prefix, e.g. `aws s3 ls` on its folder",
    Kind.BAD_CREDENTIALS: "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)",
    Kind.ACCESS_DENIED: "the credentials lack permission for this bucket or key (s3:GetObject, "
    "s3:ListBucket, s3:PutObject)",
    Kind.NO_CREDENTIALS: "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
    Kind.ALREADY_EXISTS: "pass --overwrite to replace it",
    Kind.CONNECTION_REFUSED: f"nothing listens there: {_ENDPOINT_HINT}",
    Kind.DNS: _ENDPOINT_HINT,
    Kind.TIMEOUT: f"{_ENDPOINT_HINT}; --storage-option connect_timeout=SECONDS (default 2)",
    Kind.TLS: "an https:// endpoint that speaks plain http, or a certificate not trusted: check the endpoint",
    Kind.PLAIN_HTTP: "give the endpoint as http://... in AWS_ENDPOINT_URL",
    Kind.TRANSIENT: "the store is overloaded or failing: try again later, or raise --storage-option "
    "max_retries=N / retry_timeout=SECONDS",
}


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def describe(f: Failure, e: BaseException, *, connect_timeout_s: float | None = None) -> str:
    """What happened, in words (the line without its URL)."""
    where = f.address or "the store"
    retried = f" after {f.retries} retr{'y' if f.retries == 1 else 'ies'}" if f.retries else ""
    if f.kind is Kind.CONNECTION_REFUSED:
        return f"connection refused by {where}"
    if f.kind is Kind.DNS:
        return f"cannot resolve host {where.rsplit(':', 1)[0] if f.address else ''}".rstrip()
    if f.kind is Kind.TLS:
        return f"TLS handshake with {where} failed"
    if f.kind is Kind.TIMEOUT:
        took = connect_timeout_s if connect_timeout_s is not None else f.elapsed_s
        after = f" after {took:.1f} s" if took is not None else ""
        doing = "connecting to" if "ConnectError" in f.variants else "waiting for"
        return f"timed out{after} {doing} {where}"
    if f.kind is Kind.TRANSIENT and f.status is None:
        return f"the connection dropped mid-response{retried}"
    if f.kind in (Kind.TRANSIENT, Kind.OTHER) and f.status is not None:
        detail = (
            f" {f.code}" + (f": {f.message}" if f.message and f.kind is Kind.OTHER else "") if f.code else ""
        )
        return f"the store answered HTTP {f.status}{detail}{retried}"
    if f.kind is Kind.OTHER:
        return str(e) if isinstance(e, ShortBody) else _first_line(e)
    return f.kind.value


def one_line(e: BaseException, url: object, *, connect_timeout_s: float | None = None) -> StorageError:
    """The ``StorageError`` for ``e`` on ``url``: one true line naming the URL, and a hint. A missing bucket
    or key is an ``ObjectMissing`` (what a missing file is locally)."""
    if isinstance(e, StorageError):
        return e
    f = classify(e)
    u = str(url)
    line = f"{u}: {describe(f, e, connect_timeout_s=connect_timeout_s)}"
    hint = _HINTS.get(f.kind)
    if hint is None:
        hint = (
            "the object changed while it was read: run again" if isinstance(e, ShortBody) else _ENDPOINT_HINT
        )
    cls = ObjectMissing if f.kind in (Kind.NO_BUCKET, Kind.NO_KEY) else StorageError
    return cls(line, path=u, hint=hint)
