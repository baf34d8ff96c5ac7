"""Session fixtures shared by several test files: a real S3 server (moto, 127.0.0.1, a free port) started
and stopped by the tests themselves, only when a test asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import _s3
import pytest


@pytest.fixture(scope="session")
def s3_server() -> Iterator[_s3.Server]:
    srv = _s3.start()
    srv.client().create_bucket(Bucket="ckpts")  # type: ignore[attr-defined]
    yield srv
    srv.stop()
