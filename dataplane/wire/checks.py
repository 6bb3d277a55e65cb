"""Field checks: each validates one decoded msgpack value and returns it typed, or raises
`ProtocolError` naming the field (``where``) and the rule it broke.

A message record names its fields' checks in its annotations (`dataplane.wire.messages`); the
parsers are derived from those, so a check is written once and never bound to a position.
"""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from dataplane.wire.errors import ProtocolError

INT64_MAX = (1 << 63) - 1
U63_LIMIT = 1 << 63
U64_LIMIT = 1 << 64
MAX_NAME_LEN = 256
ID_DTYPE = np.dtype("<i4")  # token and block ids: packed little-endian int32

Check = Callable[[Any, str], Any]
En = TypeVar("En", bound=enum.Enum)
C = TypeVar("C", bound=Callable[..., Any])


def wire_type(text: str) -> Callable[[C], C]:
    """Name what a check accepts, as docs/protocol.md shows it (``describe``)."""

    def mark(check: C) -> C:
        check.wire_doc = text  # type: ignore[attr-defined]
        return check

    return mark


def describe(check: Check) -> str:
    """What ``check`` accepts, in words (docs/protocol.md's type column)."""
    return str(getattr(check, "wire_doc", "see below"))


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 64, 64


def type_name(v: Any) -> str:
    return type(v).__name__


def short_repr(v: Any) -> str:
    """A bounded repr of an untrusted value for an error message: nesting, long strings and
    long lists are cut (a value nested 1,000 deep must not exhaust the stack)."""
    return _SHORT.repr(v)


def _num(n: int) -> str:
    """A bound as docs write it: powers of two (and one less) by exponent."""
    for e in range(10, 65):
        if n == 1 << e:
            return f"2^{e}"
        if n == (1 << e) - 1:
            return f"2^{e} - 1"
    return str(n)


@wire_type("u63: int in [0, 2^63)")
def u63(v: Any, where: str) -> int:
    if type(v) is not int:
        raise ProtocolError(f"{where}: expected an integer, got {type_name(v)}")
    if not 0 <= v < U63_LIMIT:
        raise ProtocolError(f"{where}: {v} is out of range [0, 2^63)")
    return v


@wire_type("u63 or nil")
def opt_u63(v: Any, where: str) -> int | None:
    return None if v is None else u63(v, where)


def small_int(lo: int, hi: int) -> Check:
    @wire_type(f"int in [{_num(lo)}, {_num(hi)}]")
    def check(v: Any, where: str) -> int:
        if type(v) is not int:
            raise ProtocolError(f"{where}: expected an integer, got {type_name(v)}")
        if not lo <= v <= hi:
            raise ProtocolError(f"{where}: {v} is out of range [{lo}, {hi}]")
        return v

    return check


def opt_small_int(lo: int, hi: int) -> Check:
    inner = small_int(lo, hi)
    return wire_type(f"int in [{_num(lo)}, {_num(hi)}] or nil")(
        lambda v, where: None if v is None else inner(v, where)
    )


def seconds(hi: float) -> Check:
    @wire_type(f"number of seconds in [0, {hi:g}]")
    def check(v: Any, where: str) -> float:
        s = number(v, where)
        if not 0.0 <= s <= hi:  # (NaN fails too)
            raise ProtocolError(f"{where}: {v!r} is not a duration in [0, {hi:g}] seconds")
        return s

    return check


@wire_type("number")
def number(v: Any, where: str) -> float:
    """An integer or a float (NaN and infinities pass: the receiver names them)."""
    if type(v) not in (int, float):
        raise ProtocolError(f"{where}: expected a number, got {type_name(v)}")
    return float(v)


@wire_type("name: str of 1-256 chars")
def name(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"{where}: expected a string, got {type_name(v)}")
    if not 0 < len(v) <= MAX_NAME_LEN:
        raise ProtocolError(f"{where}: length {len(v)} is outside [1, {MAX_NAME_LEN}]")
    return v


def blob(max_len: int) -> Check:
    @wire_type(f"bin, at most {_num(max_len)} bytes")
    def check(v: Any, where: str) -> bytes:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{where}: expected bytes, got {type_name(v)}")
        if len(v) > max_len:
            raise ProtocolError(f"{where}: {len(v)} bytes exceeds the limit of {max_len}")
        return v

    return check


@wire_type("bool")
def boolean(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{where}: expected a boolean, got {type_name(v)}")
    return v


def one_of(choices: Sequence[str]) -> Check:
    @wire_type("str: " + " or ".join(f"`{c}`" for c in choices))
    def check(v: Any, where: str) -> str:
        if not isinstance(v, str) or v not in choices:
            raise ProtocolError(f"{where}: {short_repr(v)} is not one of {', '.join(choices)}")
        return v

    return check


def member_of(cls: type[En], allowed: Sequence[En] | None = None) -> Check:
    """A string naming one of ``allowed`` (default: every member); returns the member."""
    members = list(cls) if allowed is None else list(allowed)
    values = [str(m.value) for m in members]
    by_value = dict(zip(values, members, strict=True))
    text = one_of(values)

    @wire_type(describe(text))
    def check(v: Any, where: str) -> En:
        return by_value[text(v, where)]

    return check


def int_list(length: int, lo: int, hi: int) -> Check:
    item = small_int(lo, hi)

    @wire_type(f"[int x {length}], each in [{_num(lo)}, {_num(hi)}]")
    def check(v: Any, where: str) -> tuple[int, ...]:
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected an array, got {type_name(v)}")
        if len(v) != length:
            raise ProtocolError(f"{where}: expected {length} items, got {len(v)}")
        return tuple(item(x, f"{where}[{i}]") for i, x in enumerate(v))

    return check


def array_of(lo: int, hi: int, noun: str = "items") -> Check:
    """An array of ``lo`` to ``hi`` items, returned as it is (a record checks the items)."""

    @wire_type(f"array of {_num(lo)} to {_num(hi)} {noun}")
    def check(v: Any, where: str) -> list[Any]:
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected an array, got {type_name(v)}")
        if not lo <= len(v) <= hi:
            raise ProtocolError(f"{where}: {len(v)} {noun} is outside [{lo}, {hi}]")
        return v

    return check


def id_array(max_count: int) -> Check:
    @wire_type(f"ids: bin, little-endian int32, at most {_num(max_count)}")
    def check(v: Any, where: str) -> np.ndarray:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{where}: expected bytes (little-endian int32 array), got {type_name(v)}")
        if len(v) % ID_DTYPE.itemsize:
            raise ProtocolError(f"{where}: {len(v)} bytes is not a whole number of int32 ids")
        n = len(v) // ID_DTYPE.itemsize
        if n > max_count:
            raise ProtocolError(f"{where}: {n} ids exceeds the limit of {max_count}")
        return np.frombuffer(v, dtype=ID_DTYPE)

    return check


def ids_to_bytes(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token or block ids as they travel: packed little-endian int32 (ValueError otherwise)."""
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids must be integers, got {arr.dtype}")
    if arr.ndim > 1:
        raise ValueError(f"ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < -(1 << 31) or arr.max() >= (1 << 31)):
        raise ValueError("ids must fit in int32")
    return arr.astype(ID_DTYPE, copy=False).tobytes()


@wire_type("bool or nil")
def opt_boolean(v: Any, where: str) -> bool | None:
    return None if v is None else boolean(v, where)


def text(max_len: int) -> Check:
    """Any string up to ``max_len`` characters (a reply's free text: an error's message)."""

    @wire_type(f"str, at most {_num(max_len)} chars")
    def check(v: Any, where: str) -> str:
        if not isinstance(v, str):
            raise ProtocolError(f"{where}: expected a string, got {type_name(v)}")
        if len(v) > max_len:
            raise ProtocolError(f"{where}: length {len(v)} exceeds {max_len}")
        return v

    return check


def list_of(item: Check, max_len: int) -> Check:
    """An array of at most ``max_len`` items, each checked by ``item``; returned as a tuple."""

    @wire_type(f"array of at most {_num(max_len)} ({describe(item)})")
    def check(v: Any, where: str) -> tuple[Any, ...]:
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected an array, got {type_name(v)}")
        if len(v) > max_len:
            raise ProtocolError(f"{where}: {len(v)} items exceeds the limit of {max_len}")
        return tuple(item(x, f"{where}[{i}]") for i, x in enumerate(v))

    return check


def pair(first: Check, second: Check) -> Check:
    """A two-item array ``[first, second]``; returned as a tuple."""

    @wire_type(f"[{describe(first)}; {describe(second)}]")
    def check(v: Any, where: str) -> tuple[Any, Any]:
        if not isinstance(v, list) or len(v) != 2:
            raise ProtocolError(f"{where}: expected a two-item array, got {short_repr(v)}")
        return first(v[0], f"{where}[0]"), second(v[1], f"{where}[1]")

    return check
