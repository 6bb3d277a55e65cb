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


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 64, 64


def type_name(v: Any) -> str:
    return type(v).__name__


def short_repr(v: Any) -> str:
    """A bounded repr of an untrusted value for an error message: nesting, long strings and
    long lists are cut (a value nested 1,000 deep must not exhaust the stack)."""
    return _SHORT.repr(v)


def u63(v: Any, where: str) -> int:
    if type(v) is not int:
        raise ProtocolError(f"{where}: expected an integer, got {type_name(v)}")
    if not 0 <= v < U63_LIMIT:
        raise ProtocolError(f"{where}: {v} is out of range [0, 2^63)")
    return v


def opt_u63(v: Any, where: str) -> int | None:
    return None if v is None else u63(v, where)


def small_int(lo: int, hi: int) -> Check:
    def check(v: Any, where: str) -> int:
        if type(v) is not int:
            raise ProtocolError(f"{where}: expected an integer, got {type_name(v)}")
        if not lo <= v <= hi:
            raise ProtocolError(f"{where}: {v} is out of range [{lo}, {hi}]")
        return v

    return check


def number(v: Any, where: str) -> float:
    """An integer or a float (NaN and infinities pass: the receiver names them)."""
    if type(v) not in (int, float):
        raise ProtocolError(f"{where}: expected a number, got {type_name(v)}")
    return float(v)


def name(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"{where}: expected a string, got {type_name(v)}")
    if not 0 < len(v) <= MAX_NAME_LEN:
        raise ProtocolError(f"{where}: length {len(v)} is outside [1, {MAX_NAME_LEN}]")
    return v


def blob(max_len: int) -> Check:
    def check(v: Any, where: str) -> bytes:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{where}: expected bytes, got {type_name(v)}")
        if len(v) > max_len:
            raise ProtocolError(f"{where}: {len(v)} bytes exceeds the limit of {max_len}")
        return v

    return check


def boolean(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{where}: expected a boolean, got {type_name(v)}")
    return v


def one_of(choices: Sequence[str]) -> Check:
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

    def check(v: Any, where: str) -> En:
        return by_value[text(v, where)]

    return check


def int_list(length: int, lo: int, hi: int) -> Check:
    item = small_int(lo, hi)

    def check(v: Any, where: str) -> tuple[int, ...]:
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected an array, got {type_name(v)}")
        if len(v) != length:
            raise ProtocolError(f"{where}: expected {length} items, got {len(v)}")
        return tuple(item(x, f"{where}[{i}]") for i, x in enumerate(v))

    return check


def array_of(lo: int, hi: int, noun: str = "items") -> Check:
    """An array of ``lo`` to ``hi`` items, returned as it is (a record checks the items)."""

    def check(v: Any, where: str) -> list[Any]:
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected an array, got {type_name(v)}")
        if not lo <= len(v) <= hi:
            raise ProtocolError(f"{where}: {len(v)} {noun} is outside [{lo}, {hi}]")
        return v

    return check


def id_array(max_count: int) -> Check:
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
