"""``storage_scoped``: every library operation runs with one ``zckpt.storage.session.Storage`` of its own.

The decorated function takes ``storage_options=`` (the object-store client's options) and ``storage=`` (a
``zckpt.Storage`` the caller made and keeps). The operation runs bound to, in order: ``storage`` when
given; the storage of the ``Checkpoint`` it was handed (its first argument, or ``a``/``b``), so its files
are read as that checkpoint sees them; the storage of an operation that called it; else a new one made from
``storage_options`` and closed when it returns. Nothing of it outlives the call unless the caller owns it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from zckpt.checkpoint import Checkpoint
from zckpt.storage import session

F = TypeVar("F", bound=Callable[..., Any])


def storage_scoped(fn: F) -> F:
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind_partial(*args, **kwargs)
        st = bound.arguments.get("storage")
        if st is None:
            for v in bound.arguments.values():
                if isinstance(v, Checkpoint) and v.storage is not None:
                    st = v.storage
                    break
        with session.operation(st, bound.arguments.get("storage_options")):
            return fn(*args, **kwargs)

    return cast(F, run)
