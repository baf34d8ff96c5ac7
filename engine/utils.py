"""``engine.utils``: the parts of DeepSpeed's ``deepspeed.utils`` that training scripts import.

Owns ``logger`` (DeepSpeed's ``"DeepSpeed"`` logger: level WARNING, its own stdout handler, not propagated),
``log_dist`` / ``print_dist`` (a message from the listed ranks only, prefixed ``[Rank N]``; every process logs
when there is no process group) and ``RepeatingLoader`` (a loader iterated for ever, restarting at its end).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from engine import comm

__all__ = ["RepeatingLoader", "log_dist", "logger", "print_dist"]


def _make_logger(name: str, level: int = logging.WARNING) -> logging.Logger:
    """DeepSpeed's ``LoggerFactory.create_logger``: its format, on stdout, once per process."""
    lg = logging.getLogger(name)
    lg.setLevel(level)
    lg.propagate = False
    if not lg.handlers:
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setLevel(level)
        fmt = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"
        handler.setFormatter(logging.Formatter(fmt))
        lg.addHandler(handler)
    return lg


logger = _make_logger("DeepSpeed")


def _dist_msg(message: str, ranks: list[int] | None) -> str | None:
    """The message with its rank prefix if this rank should emit it (DeepSpeed's ``get_dist_msg``)."""
    initialized = comm.is_initialized()
    my_rank = comm.get_rank() if initialized else -1
    listed = ranks or []
    show = not initialized or bool(listed) and (listed[0] == -1 or my_rank in set(listed))
    return f"[Rank {my_rank}] {message}" if show else None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the ranks listed (``[-1]``: every rank) through ``logger``."""
    final = _dist_msg(message, ranks)
    if final is not None:
        logger.log(level, final)


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    """Print ``message`` on the ranks listed (``[-1]``: every rank), whatever the log level."""
    final = _dist_msg(message, ranks)
    if final is not None:
        print(final)


class RepeatingLoader:
    """Iterate ``loader`` for ever: at its end, start it again (DeepSpeed's ``deepspeed.utils``)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
