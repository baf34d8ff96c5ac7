"""Test side only: a child interpreter started with this folder on ``PYTHONPATH`` gets ``_slow_writes``
installed when ``ZCKPT_TEST_WRITE_DELAY`` is set (see ``tests/_slow_writes.py``)."""

import os

if os.environ.get("ZCKPT_TEST_WRITE_DELAY"):
    import _slow_writes

    _slow_writes.install()
