"""Timeouts and retries of one store: the user's options (``max_retries``, ``retry_timeout``,
``connect_timeout``) as obstore's client and retry configuration, the first contact with a store
(``reach``), and the one retry zckpt makes itself (``call``).

Who retries what (measured with obstore 0.12.1 against moto through a fault-injecting proxy):

- obstore retries, up to ``max_retries`` times and no later than ``retry_timeout`` after the first attempt,
  with exponential backoff and jitter (50 ms doubling to 5 s): 5xx and 429 answers (503 SlowDown
  included), connection errors (refused, unknown host, connect timeout, TLS), dropped connections, timeouts
  of safe requests, and a GET body cut off mid-way, which it resumes (``get_range`` and streamed ``get``).
- zckpt retries only what obstore reports without retrying it: the body of a listing cut off mid-way
  (object_store reads it after its retry loop has returned; ``failures.Failure.retry_here``), within the
  same two bounds and with the same backoff. Nothing is retried because of its message text; 4xx answers
  are final.

A store that cannot be reached at all would cost ``max_retries`` backoffs of every request before anything
is said (a closed port: 1.5 s of obstore's retries, then 6 more rounds of zckpt's retries on top, 13 s in
all). ``reach`` makes one request without retries when a store is first built: refused, unknown host,
``connect_timeout`` exceeded or a failed TLS handshake is the command's one line at once; any answer, even
an error, means the store is there, and the operation goes on with the retrying client.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from zckpt.errors import StorageError
from zckpt.storage.objstore.failures import classify, one_line

T = TypeVar("T")

OWN_KEYS = frozenset({"max_retries", "retry_timeout", "connect_timeout"})
"""The storage options read here (the other keys go to the client)."""
INIT_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0


@dataclass(frozen=True)
class Policy:
    """How long to wait and how often to retry, from the storage options (every field has an option of its
    name, in seconds for times)."""

    max_retries: int = 10
    retry_timeout: float = 180.0
    """No retry starts later than this many seconds after a request's first attempt."""
    connect_timeout: float = 2.0
    """Seconds to open a connection (the AWS SDK for Java's default)."""
    timeout: float = 120.0
    """Seconds for a whole request (the client's; not an option)."""

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> Policy:
        """The policy the options ask for; a value that is not a number is refused in one line."""
        kw: dict[str, Any] = {}
        for key, kind in (("max_retries", int), ("retry_timeout", float), ("connect_timeout", float)):
            if key not in options:
                continue
            try:
                v = kind(options[key])
            except ValueError:
                v = -1
            if v < 0 or (key == "connect_timeout" and v == 0):
                raise StorageError(
                    f"--storage-option {key}={options[key]}: not a {'count' if kind is int else 'time'}",
                    hint=f"e.g. --storage-option {key}={'3' if kind is int else '2.5'}",
                )
            kw[key] = v
        return cls(**kw)

    def client_options(self, endpoint: str | None) -> dict[str, Any]:
        """obstore's ``ClientConfig``: the timeouts, and plain http when the endpoint's URL says http."""
        out: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=self.connect_timeout),
            "timeout": timedelta(seconds=self.timeout),
        }
        if endpoint and endpoint.startswith("http://"):
            out["allow_http"] = True  # the endpoint's URL says http: that is the user's choice
        return out

    def retry_config(self) -> dict[str, Any]:
        """obstore's ``RetryConfig``."""
        return {
            "max_retries": self.max_retries,
            "retry_timeout": timedelta(seconds=self.retry_timeout),
            "backoff": {
                "init_backoff": timedelta(seconds=INIT_BACKOFF_S),
                "max_backoff": timedelta(seconds=MAX_BACKOFF_S),
                "base": 2,
            },
        }


def reach(
    make: Callable[[dict[str, Any], dict[str, Any]], Any], url: object, policy: Policy, endpoint: str | None
) -> None:
    """Raise the one line if the store cannot be reached: one HEAD of the bucket's root, no retry, through
    a client that ``make(client_options, retry_config)`` builds like the real one (same endpoint, proxy,
    credentials). Any answer (200, 403, 404, 5xx...), a dropped connection or a slow answer passes: the
    request that follows has the retries and says what is wrong with it."""
    import obstore

    try:
        obstore.head(make(policy.client_options(endpoint), {"max_retries": 0}), "")
    except Exception as e:  # noqa: BLE001 - classified: only an unreachable store stops here
        if classify(e).connect_phase:
            raise one_line(e, url) from None


def call(fn: Callable[[], T], url: object, policy: Policy, on_retry: Callable[[], None] | None = None) -> T:
    """``fn()`` (one request to the client); its error as ``failures.one_line``. Retried only when the
    client reports a transient failure without having retried it (``Failure.retry_here``), up to
    ``policy.max_retries`` times within ``policy.retry_timeout`` seconds, with obstore's backoff."""
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except StorageError:
            raise
        except Exception as e:  # noqa: BLE001 - classified
            late = time.monotonic() - start > policy.retry_timeout
            if attempt >= policy.max_retries or late or not classify(e).retry_here:
                raise one_line(e, url) from None
        if on_retry is not None:
            on_retry()
        backoff = min(MAX_BACKOFF_S, INIT_BACKOFF_S * 2**attempt)
        time.sleep(random.uniform(INIT_BACKOFF_S, max(INIT_BACKOFF_S, backoff)))
        attempt += 1
