"""`dataplane.wire.checks`: every field check, on the values it accepts and the ones it
refuses, naming the field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dataplane.wire import checks as c
from dataplane.wire.errors import ProtocolError


class TestU63:
    @pytest.mark.parametrize("v", [0, 1, (1 << 63) - 1])
    def test_accepts_range(self, v: int) -> None:
        assert c.u63(v, "x") == v

    @pytest.mark.parametrize("v", [-1, -(1 << 63), 1 << 63, (1 << 64) - 1])
    def test_rejects_out_of_range(self, v: int) -> None:
        with pytest.raises(ProtocolError, match=r"x: -?\d+ is out of range \[0, 2\^63\)"):
            c.u63(v, "x")

    @pytest.mark.parametrize("v", [True, 1.0, "1", None, b"1", [1]])
    def test_rejects_non_int(self, v: Any) -> None:
        with pytest.raises(ProtocolError, match=f"x: expected an integer, got {type(v).__name__}"):
            c.u63(v, "x")

    def test_optional(self) -> None:
        assert c.opt_u63(None, "x") is None
        assert c.opt_u63(5, "x") == 5
        with pytest.raises(ProtocolError, match="out of range"):
            c.opt_u63(-5, "x")


def test_small_int() -> None:
    check = c.small_int(1, 10)
    assert check(1, "f") == 1 and check(10, "f") == 10
    with pytest.raises(ProtocolError, match=r"f: 0 is out of range \[1, 10\]"):
        check(0, "f")
    with pytest.raises(ProtocolError, match=r"f: 11 is out of range \[1, 10\]"):
        check(11, "f")
    with pytest.raises(ProtocolError, match="f: expected an integer, got bool"):
        check(True, "f")
    with pytest.raises(ProtocolError, match="f: expected an integer, got float"):
        check(2.0, "f")


def test_name() -> None:
    assert c.name("model", "n") == "model"
    assert c.name("x" * c.MAX_NAME_LEN, "n") == "x" * c.MAX_NAME_LEN
    with pytest.raises(ProtocolError, match=r"n: length 0 is outside \[1, 256\]"):
        c.name("", "n")
    with pytest.raises(ProtocolError, match=r"n: length 257 is outside \[1, 256\]"):
        c.name("x" * 257, "n")
    with pytest.raises(ProtocolError, match="n: expected a string, got bytes"):
        c.name(b"model", "n")


def test_blob() -> None:
    check = c.blob(4)
    assert check(b"abcd", "b") == b"abcd"
    assert check(b"", "b") == b""
    with pytest.raises(ProtocolError, match="b: 5 bytes exceeds the limit of 4"):
        check(b"abcde", "b")
    with pytest.raises(ProtocolError, match="b: expected bytes, got str"):
        check("abcd", "b")


def test_boolean() -> None:
    assert c.boolean(True, "b") is True
    assert c.boolean(False, "b") is False
    for v in (0, 1, "true", None):
        with pytest.raises(ProtocolError, match="b: expected a boolean"):
            c.boolean(v, "b")


def test_one_of() -> None:
    check = c.one_of(("a", "b"))
    assert check("b", "c") == "b"
    with pytest.raises(ProtocolError, match="c: 'z' is not one of a, b"):
        check("z", "c")
    for v in (1, None, [1], {"a": 1}, b"a"):
        with pytest.raises(ProtocolError, match="is not one of a, b"):
            check(v, "c")


def test_int_list() -> None:
    check = c.int_list(3, 0, 9)
    assert check([0, 5, 9], "l") == (0, 5, 9)
    with pytest.raises(ProtocolError, match="l: expected an array, got tuple"):
        check((1, 2, 3), "l")
    with pytest.raises(ProtocolError, match="l: expected 3 items, got 2"):
        check([1, 2], "l")
    with pytest.raises(ProtocolError, match=r"l\[2\]: 10 is out of range \[0, 9\]"):
        check([1, 2, 10], "l")
    with pytest.raises(ProtocolError, match=r"l\[0\]: expected an integer, got str"):
        check(["1", 2, 3], "l")


class TestIdArray:
    def test_roundtrip(self) -> None:
        ids = [0, 1, -5, (1 << 31) - 1, -(1 << 31)]
        got = c.id_array(10)(c.ids_to_bytes(ids), "t")
        assert got.dtype == c.ID_DTYPE
        assert got.tolist() == ids

    def test_empty(self) -> None:
        assert len(c.id_array(10)(b"", "t")) == 0

    @pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 4097])
    def test_not_whole_int32(self, n: int) -> None:
        with pytest.raises(ProtocolError, match=f"t: {n} bytes is not a whole number of int32 ids"):
            c.id_array(10_000)(b"\x01" * n, "t")

    def test_too_many(self) -> None:
        with pytest.raises(ProtocolError, match="t: 11 ids exceeds the limit of 10"):
            c.id_array(10)(b"\x00" * 44, "t")

    @pytest.mark.parametrize("v", [[1, 2, 3], "abcd", 7, None, bytearray(b"abcd")])
    def test_wrong_type(self, v: Any) -> None:
        with pytest.raises(ProtocolError, match="t: expected bytes"):
            c.id_array(10)(v, "t")

    def test_little_endian(self) -> None:
        assert c.id_array(1)(b"\x01\x00\x00\x00", "t").tolist() == [1]

    def test_ids_to_bytes_rejects_overflow(self) -> None:
        with pytest.raises(ValueError, match="int32"):
            c.ids_to_bytes([1 << 31])
        with pytest.raises(ValueError, match="int32"):
            c.ids_to_bytes(np.array([-(1 << 31) - 1], dtype=np.int64))
        assert c.ids_to_bytes([]) == b""
