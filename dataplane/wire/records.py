"""The base of every wire record and what is derived from a record's declaration: its fields'
checks (``field_checks``), decoding a positional payload (``decode_record``) and encoding one
(``encode_payload``). The records themselves are declared in `dataplane.wire.messages`, which
re-exports these names."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, TypeVar, get_type_hints

import numpy as np

from dataplane.wire.checks import Check, ids_to_bytes, type_name
from dataplane.wire.errors import ProtocolError
from dataplane.wire.kinds import MsgType

R = TypeVar("R", bound="Record")


class Record:
    """Base of every payload record: its fields are its positional payload fields."""

    __slots__ = ()

    def _checked(self: R, where: str) -> R:
        """Cross-field rules, run after every field passed its own check."""
        return self


class Message(Record):
    """A record that is a whole request's payload; ``TYPE`` names the message."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]


def _spec_of(cls: type[Record]) -> tuple[tuple[str, Check], ...]:
    hints = get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return tuple((f.name, hints[f.name].__metadata__[0]) for f in fields)


# each record's spec, derived on first use (a benign race: two threads derive the same tuple)
_SPECS: dict[type[Record], tuple[tuple[str, Check], ...]] = {}


def field_checks(cls: type[Record]) -> tuple[tuple[str, Check], ...]:
    """``(field name, check)`` of every payload field of ``cls``, in wire order."""
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = _spec_of(cls)
    return spec


def field_names(cls: type[Record]) -> tuple[str, ...]:
    return tuple(n for n, _ in field_checks(cls))


RecT = TypeVar("RecT", bound=Record)


def decode_record(cls: type[RecT], v: Any, where: str) -> RecT:
    """Check a positional payload against ``cls``'s declaration; the typed record."""
    spec = field_checks(cls)
    if not isinstance(v, list):
        raise ProtocolError(f"{where}: payload must be an array, got {type_name(v)}")
    if len(v) != len(spec):
        names = ", ".join(n for n, _ in spec) or "nothing"
        raise ProtocolError(f"{where}: expected {len(spec)} payload fields ({names}), got {len(v)}")
    vals = [check(x, f"{where}.{fname}") for (fname, check), x in zip(spec, v, strict=True)]
    return cls(*vals)._checked(where)


def encode_payload(msg: Record) -> list[Any]:
    """The positional payload of a record, as it travels (ids packed, enums as strings)."""
    return [_encode_value(getattr(msg, n)) for n in field_names(type(msg))]


def _encode_value(v: Any) -> Any:
    if isinstance(v, Record):
        return encode_payload(v)
    if isinstance(v, np.ndarray):
        return ids_to_bytes(v)
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple | list):
        return [_encode_value(x) for x in v]
    return v
