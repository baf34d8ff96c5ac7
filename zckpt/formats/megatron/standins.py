"""Inert stand-ins for the Python classes Megatron-Core pickles into ``common.pt`` (and the distributed
optimizer's small byte objects), so they load through zckpt's allowlisted unpickler without Megatron.

Found in real megatron-core 0.16.1 ``torch_dist`` saves: ``argparse.Namespace`` (``args``; already a zckpt
stand-in), ``signal.Signals`` (``args.exit_signal``) and Megatron's enums (``ModelType``, ``AttnBackend``),
each pickled as ``REDUCE(cls, (value,))``. An enum becomes an ``EnumValue`` record (class name, value); a
signal its number. Nothing is imported or called from Megatron. Enums of other Megatron versions are allowed
by name from the same modules (``ENUMS``): a REDUCE of them only builds a record.
"""

from __future__ import annotations

from typing import Any

from zckpt.codecs.pickle_core import _Record
from zckpt.errors import CorruptCheckpoint


class EnumValue(_Record):
    """A Megatron enum member as pickled: ``cls`` (its class's dotted name) and ``value``."""

    def __repr__(self) -> str:
        return f"{self.__dict__.get('cls')}({self.__dict__.get('value')!r})"


class SignalNumber(int):
    """``signal.Signals(n)``: kept as its number."""


def _signal(value: Any) -> SignalNumber:
    if type(value) is not int or not 0 <= value < 256:
        raise CorruptCheckpoint(f"signal.Signals({value!r:.40}) is not a signal number")
    return SignalNumber(value)


def _enum(cls: str) -> Any:
    def build(value: Any = None) -> EnumValue:
        if not isinstance(value, (int, str)) or isinstance(value, bool) or len(str(value)) > 64:
            raise CorruptCheckpoint(f"{cls}({value!r:.40}): not an enum value")
        rec = EnumValue()
        rec.__dict__.update(cls=cls, value=value)
        return rec

    build.__qualname__ = cls
    return build


ENUMS: dict[str, tuple[str, ...]] = {
    "megatron.core.enums": ("ModelType", "Fp8Recipe", "Fp4Recipe"),
    "megatron.core.transformer.enums": (
        "ModelType", "AttnBackend", "AttnMaskType", "AttnType", "LayerType", "CudaGraphScope",
    ),
}  # fmt: skip
"""Megatron enums ``common.pt`` may name, by module."""

ALLOWED: dict[tuple[str, str], Any] = {
    ("signal", "Signals"): _signal,
    **{(mod, name): _enum(f"{mod}.{name}") for mod, names in ENUMS.items() for name in names},
}
"""The globals a Megatron ``common.pt`` may name besides zckpt's torch allowlist (``safe_loads``'s
``extra``)."""
