"""The base of every wire record and what is derived from a record's declaration: its fields'
checks (``field_checks``) and documentation (``field_docs``), decoding a positional payload
(``decode_record``) and encoding one (``encode_payload``), and the same for a reply, which
travels as a map of its fields (``decode_reply_map``, ``reply_to_wire``).

A field is declared ``Annotated[type, check]`` or ``Annotated[type, check, "what it means"]``.
Requests are declared in `dataplane.wire.messages`, replies in `dataplane.wire.replies`, and
which reply answers which request, and who handles it, in `dataplane.wire.table`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, Generic, TypeVar, get_type_hints

import numpy as np

from dataplane.wire.checks import Check, describe, ids_to_bytes, short_repr, type_name, wire_type
from dataplane.wire.errors import ProtocolError
from dataplane.wire.kinds import MsgType

R = TypeVar("R", bound="Record")


class Record:
    """Base of every payload record: its fields are its positional payload fields."""

    __slots__ = ()

    def _checked(self: R, where: str) -> R:
        """Cross-field rules, run after every field passed its own check."""
        return self


class Reply(Record):
    """A record that is a whole reply's body: it travels as a map of its fields."""

    __slots__ = ()


RepT = TypeVar("RepT", bound=Reply, covariant=True)


class Message(Record, Generic[RepT]):
    """A record that is a whole request's payload; ``TYPE`` names the message, the type
    parameter the reply that answers it (`dataplane.wire.table` holds the rest)."""

    __slots__ = ()
    TYPE: ClassVar[MsgType]


FieldDoc = tuple[str, Check, str]  # (name, check, what it means)


def _spec_of(cls: type[Record]) -> tuple[FieldDoc, ...]:
    hints = get_type_hints(cls, include_extras=True)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    out = []
    for f in fields:
        meta = hints[f.name].__metadata__
        out.append((f.name, meta[0], str(meta[1]) if len(meta) > 1 else ""))
    return tuple(out)


# each record's spec, derived on first use (a benign race: two threads derive the same tuple)
_SPECS: dict[type[Record], tuple[FieldDoc, ...]] = {}
_CHECKS: dict[type[Record], tuple[tuple[str, Check], ...]] = {}
_NAMES: dict[type[Record], tuple[str, ...]] = {}


def field_docs(cls: type[Record]) -> tuple[FieldDoc, ...]:
    """``(field name, check, meaning)`` of every field of ``cls``, in wire order."""
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = _spec_of(cls)
    return spec


def field_checks(cls: type[Record]) -> tuple[tuple[str, Check], ...]:
    """``(field name, check)`` of every payload field of ``cls``, in wire order."""
    checks = _CHECKS.get(cls)
    if checks is None:
        checks = _CHECKS[cls] = tuple((n, c) for n, c, _ in field_docs(cls))
    return checks


def field_names(cls: type[Record]) -> tuple[str, ...]:
    """The field names of ``cls``, in wire order (what both encoders read, every message)."""
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(n for n, _ in field_checks(cls))
    return names


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


# ------------------------------------------------------------------------------ replies


def decode_reply_map(cls: type[RecT], v: Any, where: str) -> RecT:
    """Check a reply body (a map) against ``cls``'s declaration: exactly its fields, each
    passing its check; the typed record."""
    spec = field_checks(cls)
    if not isinstance(v, dict):
        raise ProtocolError(f"{where}: a reply must be a map, got {type_name(v)}")
    if len(v) != len(spec) or any(n not in v for n, _ in spec):
        missing = [n for n, _ in spec if n not in v]
        extra = sorted(short_repr(k) for k in v if k not in {n for n, _ in spec})
        raise ProtocolError(f"{where}: fields missing {missing or 'none'}, unknown {extra or 'none'}")
    vals = [check(v[fname], f"{where}.{fname}") for fname, check in spec]
    return cls(*vals)._checked(where)


def record_map(cls: type[RecT]) -> Check:
    """A field holding a nested reply record (a map)."""

    @wire_type(f"map: {cls.__name__}")
    def check(v: Any, where: str) -> RecT:
        return decode_reply_map(cls, v, where)

    return check


def opt_record_map(cls: type[RecT]) -> Check:
    inner = record_map(cls)

    @wire_type(f"{describe(inner)} or nil")
    def check(v: Any, where: str) -> RecT | None:
        return None if v is None else inner(v, where)

    return check


def reply_to_wire(v: Any) -> Any:
    """msgpack's ``default`` hook: a reply record (at any depth) as the map of its fields."""
    if isinstance(v, Reply):
        return {n: getattr(v, n) for n in field_names(type(v))}
    raise TypeError(f"cannot encode {type_name(v)} in a reply")
