"""The wire format: framing, every validator, and the typed payload parsers."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Annotated, Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.wire import checks as c
from dataplane.wire import messages as m
from dataplane.wire import protocol as p
from dataplane.wire.errors import FrameTooLarge, ProtocolError, ShuttingDown, VersionMismatch
from dataplane.wire.table import PARSERS
from tests.dataplane.registration import SECRET, engine_register_message

IID = 123456789
V = p.PROTOCOL_VERSION
NO_IDS = np.zeros(0, dtype=c.ID_DTYPE)


def raw(version: Any, rid: Any, mtype: Any, payload: Any) -> list[Any]:
    return [version, rid, mtype, payload]


def decode(mtype: str, payload: Any, rid: int = 7) -> p.Request:
    return p.decode_request(raw(p.PROTOCOL_VERSION, rid, mtype, payload))


def roundtrip(frame: bytes, limit: int = p.DEFAULT_MAX_FRAME_BYTES) -> p.Request:
    return p.decode_request(p.unpack(frame, limit))


def payload_of(msg: m.Record, **over: Any) -> list[Any]:
    """``msg``'s payload as it travels, the named fields replaced by raw (wire) values."""
    out = m.encode_payload(msg)
    names = m.field_names(type(msg))
    for field, value in over.items():
        out[names.index(field)] = value
    return out


def in_wire_order(cls: type[m.Record], vals: dict[str, Any]) -> list[Any]:
    assert set(vals) == set(m.field_names(cls)), set(vals) ^ set(m.field_names(cls))
    return [vals[n] for n in m.field_names(cls)]


def shm_register(**over: Any) -> list[Any]:
    vals: dict[str, Any] = {
        "instance_id": IID,
        "secret": SECRET,
        "model_name": "m",
        "world_size": 2,
        "worker_id": 1,
        "transfer_mode": "server_driven",
        "memory": "shm",
        "dtype": "bfloat16",
        "kv_shape": [2, 64, 16, 2, 8],
        "owner_pid": 4242,
        "layers": [
            ["kvwarden-1-0123456789abcdef", 0, [16384, 256, 16, 8, 1]],
            ["kvwarden-1-0123456789abcdef", 32768, [16384, 256, 16, 8, 1]],
        ],
    }
    vals.update(over)
    return in_wire_order(m.Register, vals)


def cuda_layer(**over: Any) -> list[Any]:
    vals: dict[str, Any] = {
        "device_uuid": "GPU-1234",
        "device_index": 0,
        "ipc_handle": b"h" * 64,
        "storage_nbytes": 1 << 20,
        "storage_offset": 0,
        "tensor_offset": 0,
        "ref_counter_handle": b"r" * 16,
        "ref_counter_offset": 0,
        "event_handle": b"e" * 64,
        "event_sync_required": True,
        "strides": [16384, 256, 16, 8, 1],
    }
    vals.update(over)
    return in_wire_order(m.CudaLayer, vals)


def instance_messages() -> list[m.Message]:
    """One valid message of every type that names an instance (all carry its secret)."""
    tok = np.arange(2 * 16)
    return [
        m.Ping(IID, SECRET),
        PARSERS[m.MsgType.REGISTER_KV_CACHE](shm_register()),
        m.Unregister(IID, SECRET),
        m.Store(IID, SECRET, tok, np.array([3, 1])),
        m.Retrieve(IID, SECRET, tok, np.array([3, 1])),
        m.Lookup(IID, SECRET, tok),
        engine_register_message(IID),
        m.EngineStore(IID, SECRET, tok, 0, 2),
        m.EngineRetrieve(IID, SECRET, tok, 0, 2),
        m.BlendStore(IID, SECRET, tok, np.array([3, 1]), 16),
        m.BlendReserve(IID, SECRET, tok),
        m.BlendAcquire(IID, SECRET, tok),
    ]


INSTANCE_MESSAGES = instance_messages()


# ------------------------------------------------------------------------------- validators


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


@dataclasses.dataclass(frozen=True, slots=True)
class _AB(m.Record):
    a: Annotated[int, c.u63]
    b: Annotated[str, c.name]


def test_fields() -> None:
    assert m.field_names(_AB) == ("a", "b")
    assert m.decode_record(_AB, [1, "x"], "MSG") == _AB(1, "x")
    assert m.encode_payload(_AB(1, "x")) == [1, "x"]
    with pytest.raises(ProtocolError, match="MSG: payload must be an array, got dict"):
        m.decode_record(_AB, {"a": 1}, "MSG")
    with pytest.raises(ProtocolError, match=r"MSG: expected 2 payload fields \(a, b\), got 3"):
        m.decode_record(_AB, [1, "x", 3], "MSG")
    with pytest.raises(ProtocolError, match=r"MSG: expected 0 payload fields \(nothing\), got 1"):
        m.decode_record(m.Hello, [1], "MSG")
    with pytest.raises(ProtocolError, match=r"MSG\.b: expected a string"):
        m.decode_record(_AB, [1, 2], "MSG")


# ------------------------------------------------------------------------------ framing


class TestFraming:
    def test_roundtrip_every_simple_type(self) -> None:
        tok = c.ids_to_bytes(range(40))
        blk = c.ids_to_bytes([3, 1, 2])
        assert roundtrip(p.encode_request(1, m.MsgType.HELLO, [])).payload == m.Hello()
        assert roundtrip(p.encode_request(1, m.MsgType.GET_SERVER_INFO, [])).type is m.MsgType.GET_SERVER_INFO
        assert roundtrip(p.encode_message(2, m.Ping(None, None))).payload == m.Ping(None, None)
        assert roundtrip(p.encode_message(2, m.Ping(IID, SECRET))).payload == m.Ping(IID, SECRET)
        unreg = m.Unregister(IID, SECRET)
        assert roundtrip(p.encode_message(3, unreg)).payload == unreg
        for cls in (m.Store, m.Retrieve):
            req = roundtrip(p.encode_message(9, cls(IID, SECRET, np.arange(40), np.array([3, 1, 2]))))
            assert req.request_id == 9 and req.type is cls.TYPE
            assert isinstance(req.payload, cls)
            assert req.payload.instance_id == IID
            assert req.payload.secret == SECRET
            assert req.payload.token_ids.tolist() == list(range(40))
            assert req.payload.block_ids.tolist() == [3, 1, 2]
        req = roundtrip(p.encode_message(4, m.Lookup(IID, SECRET, np.arange(40))))
        assert isinstance(req.payload, m.Lookup)
        assert req.payload.secret == SECRET
        assert req.payload.token_ids.tolist() == list(range(40))
        # what travels: ids packed, the secret as bytes right after the instance id
        assert m.encode_payload(m.Store(IID, SECRET, np.arange(40), np.array([3, 1, 2]))) == [
            IID,
            SECRET,
            tok,
            blk,
            None,  # no key context
        ]
        assert m.encode_payload(m.Lookup(IID, SECRET, np.arange(40))) == [IID, SECRET, tok, None]
        ctx = m.KeyContext(b"tenant", b"adapter", ((-3, 5, b"img"), (5, 9, b"emb")))
        assert m.encode_payload(m.Lookup(IID, SECRET, np.arange(40), ctx)) == [
            IID,
            SECRET,
            tok,
            [b"tenant", b"adapter", [[-3, 5, b"img"], [5, 9, b"emb"]]],
        ]
        req = roundtrip(p.encode_message(4, m.Lookup(IID, SECRET, np.arange(40), ctx)))
        assert isinstance(req.payload, m.Lookup) and req.payload.key == ctx
        assert m.encode_payload(m.Ping(None, None)) == [None, None]

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=lambda msg: type(msg).__name__)
    def test_every_instance_message_roundtrips_its_secret(self, msg: m.Message) -> None:
        names = m.field_names(type(msg))
        assert names[:2] == ("instance_id", "secret")  # the secret travels at index 1
        raw_payload = m.encode_payload(msg)
        assert raw_payload[:2] == [IID, SECRET]
        req = roundtrip(p.encode_message(5, msg))
        assert req.type is msg.TYPE and type(req.payload) is type(msg)
        assert req.payload.instance_id == IID  # type: ignore[attr-defined]
        assert req.payload.secret == SECRET  # type: ignore[attr-defined]
        assert m.encode_payload(req.payload) == raw_payload  # nothing lost or reordered

    def test_request_id_full_u64_range(self) -> None:
        assert roundtrip(p.encode_request((1 << 64) - 1, "HELLO", [])).request_id == (1 << 64) - 1
        with pytest.raises(ProtocolError, match=r"request_id: expected an integer in \[0, 2\^64\)"):
            p.decode_request([V, -1, "HELLO", []])
        with pytest.raises(ProtocolError, match="request_id"):
            p.decode_request([V, "7", "HELLO", []])

    def test_frame_too_large(self) -> None:
        frame = p.encode_message(1, m.Lookup(IID, SECRET, np.arange(2000)))
        assert len(frame) > 4096
        with pytest.raises(
            FrameTooLarge, match=f"frame of {len(frame)} bytes exceeds the limit of 4096 bytes"
        ) as exc:
            p.unpack(frame, 4096)
        assert exc.value.code == "FRAME_TOO_LARGE"
        assert isinstance(exc.value, ProtocolError)
        # exactly at the limit is fine
        assert p.unpack(frame, len(frame))[2] == "LOOKUP"

    def test_frame_too_large_is_checked_before_decoding(self) -> None:
        with pytest.raises(FrameTooLarge):
            p.unpack(b"\xc1" * 5000, 4096)  # 0xc1 is never valid msgpack

    @pytest.mark.parametrize(
        "data",
        [b"", b"\x94\x01", b"\xc1", b"\xda\x00\x10ab", p.encode_request(1, "HELLO", [])[:-1]],
    )
    def test_truncated_or_garbage(self, data: bytes) -> None:
        with pytest.raises(ProtocolError, match="undecodable frame"):
            p.unpack(data, 4096)

    def test_map_keys_must_be_strings(self) -> None:
        data = msgpack.packb([1, 1, "HELLO", {1: 2}])
        with pytest.raises(ProtocolError, match="undecodable frame"):
            p.unpack(data, 4096)

    def test_protocol_version_is_5(self) -> None:
        assert p.PROTOCOL_VERSION == 5

    def test_version_mismatch_names_both_versions(self) -> None:
        with pytest.raises(VersionMismatch) as exc:
            roundtrip(p.encode_request(1, "HELLO", [], version=3))
        msg = str(exc.value)
        assert "v3" in msg and f"v{p.PROTOCOL_VERSION}" in msg
        assert "client speaks v3" in msg and "server speaks v5" in msg
        assert exc.value.code == "VERSION_MISMATCH"

    @pytest.mark.parametrize(
        ("mtype", "v1_payload"),
        [("HELLO", []), ("PING", [None]), ("PING", [IID]), ("UNREGISTER_KV_CACHE", [IID])],
    )
    def test_v1_client_gets_version_mismatch(self, mtype: str, v1_payload: list[Any]) -> None:
        """A v1 client's frame (its payload without a secret) is refused for its version, not
        for its payload: it learns to upgrade, not that its PING is malformed."""
        with pytest.raises(VersionMismatch) as exc:
            roundtrip(p.encode_request(1, mtype, v1_payload, version=1))
        assert "client speaks v1, server speaks v5" in str(exc.value)
        assert exc.value.code == "VERSION_MISMATCH"

    def test_version_checked_before_everything_else(self) -> None:
        with pytest.raises(VersionMismatch, match="client speaks v0"):
            p.decode_request([0, "bad id", 42, "bad payload"])

    def test_version_must_be_int(self) -> None:
        with pytest.raises(ProtocolError, match=r"request\.version: expected an integer, got str"):
            p.decode_request(["1", 1, "HELLO", []])
        with pytest.raises(ProtocolError, match=r"request\.version: expected an integer, got bool"):
            p.decode_request([True, 1, "HELLO", []])

    @pytest.mark.parametrize(
        "frame", [[], [1, 1, "HELLO"], [1, 1, "HELLO", [], 5], {"v": 1}, "HELLO", 17, None]
    )
    def test_request_shape(self, frame: Any) -> None:
        with pytest.raises(
            ProtocolError,
            match=r"request must be \[version, request_id, type, "
            r"payload\]",
        ):
            p.decode_request(frame)

    def test_unknown_type(self) -> None:
        with pytest.raises(
            ProtocolError,
            match=r"request\.type: unknown message type 'FROB'; "
            r"known: HELLO, ",
        ) as exc:
            decode("FROB", [])
        assert "LOOKUP" in str(exc.value)

    def test_unknown_type_is_truncated_in_message(self) -> None:
        with pytest.raises(ProtocolError) as exc:
            decode("Z" * 10_000, [])
        assert len(str(exc.value)) < 500

    def test_type_must_be_string(self) -> None:
        with pytest.raises(ProtocolError, match=r"request\.type: expected a string, got int"):
            decode(3, [])  # type: ignore[arg-type]

    def test_peek_request_id(self) -> None:
        assert p.peek_request_id([1, 99, "X"]) == 99
        assert p.peek_request_id([1, -1]) == 0
        assert p.peek_request_id([1, "7"]) == 0
        assert p.peek_request_id(None) == 0
        assert p.peek_request_id({"a": 1}) == 0
        assert p.peek_request_id([1, 1 << 64]) == 0

    def test_reply_roundtrip(self) -> None:
        r = p.decode_reply(p.encode_ok(5, {"hit_tokens": 32}))
        assert r == p.ReplyFrame(5, True, {"hit_tokens": 32})
        r = p.decode_reply(p.encode_error(6, FrameTooLarge("too big")))
        assert r == p.ReplyFrame(6, False, {"code": "FRAME_TOO_LARGE", "message": "too big"})
        r = p.decode_reply(p.encode_error(7, ShuttingDown("server is stopping")))
        assert r.body == {"code": "SHUTTING_DOWN", "message": "server is stopping"}

    def test_reply_version_mismatch_names_both(self) -> None:
        data = msgpack.packb([9, 1, True, None])
        with pytest.raises(VersionMismatch, match="server speaks v9, client speaks v5"):
            p.decode_reply(data)
        with pytest.raises(VersionMismatch, match="server speaks v1, client speaks v5"):
            p.decode_reply(msgpack.packb([1, 1, True, None]))
        with pytest.raises(ProtocolError, match="malformed reply"):
            p.decode_reply(msgpack.packb([1, 1, True]))


# ----------------------------------------------------------------------- payload parsers


PING = m.Ping(IID, SECRET)
UNREG = m.Unregister(IID, SECRET)
STORE = m.Store(IID, SECRET, NO_IDS, NO_IDS)
RETRIEVE = m.Retrieve(IID, SECRET, NO_IDS, NO_IDS)
LOOKUP = m.Lookup(IID, SECRET, NO_IDS)
S = SECRET


@pytest.mark.parametrize(
    ("mtype", "payload", "message"),
    [
        ("HELLO", [1], r"HELLO: expected 0 payload fields \(nothing\), got 1"),
        ("HELLO", None, "HELLO: payload must be an array, got NoneType"),
        ("GET_SERVER_INFO", [None], "GET_SERVER_INFO: expected 0 payload fields"),
        ("PING", [], r"PING: expected 2 payload fields \(instance_id, secret\), got 0"),
        ("PING", [1, S, 2], r"PING: expected 2 payload fields \(instance_id, secret\), got 3"),
        ("PING", payload_of(PING, instance_id="x"), "PING.instance_id: expected an integer, got str"),
        ("PING", payload_of(PING, instance_id=1.5), "PING.instance_id: expected an integer, got float"),
        ("PING", payload_of(PING, instance_id=-1), r"PING.instance_id: -1 is out of range \[0, 2\^63\)"),
        (
            "PING",
            payload_of(PING, instance_id=1 << 63),
            r"PING.instance_id: 9223372036854775808 is out of range",
        ),
        (
            "UNREGISTER_KV_CACHE",
            payload_of(UNREG, instance_id=None),
            "UNREGISTER_KV_CACHE.instance_id: expected an integer",
        ),
        ("UNREGISTER_KV_CACHE", [], r"UNREGISTER_KV_CACHE: expected 2 payload fields"),
        (
            "STORE",
            [IID, S, b""],
            r"STORE: expected 5 payload fields \(instance_id, secret, token_ids, "
            r"block_ids, key\), got 3",
        ),
        ("STORE", payload_of(STORE, token_ids=[1, 2]), "STORE.token_ids: expected bytes"),
        ("STORE", payload_of(STORE, key=b"salt"), "STORE.key: payload must be an array, got bytes"),
        ("STORE", payload_of(STORE, key=[b"s", b""]), r"STORE.key: expected 3 payload fields"),
        ("LOOKUP", payload_of(LOOKUP, key=["s", b"", []]), "LOOKUP.key.salt: expected bytes, got str"),
        ("LOOKUP", payload_of(LOOKUP, key=[b"s" * 257, b"", []]), "LOOKUP.key.salt: 257 bytes exceeds"),
        ("LOOKUP", payload_of(LOOKUP, key=[b"", b"n" * 257, []]), "LOOKUP.key.namespace: 257 bytes"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[0, 4]]]), r"RETRIEVE.key.spans\[0\]: expected"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[4, 4, b"d"]]]), r"\[4, 4\) is not a range"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[0, 1.5, b"d"]]]), "must be integers"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[0, 8, b""]]]), "digest must be 1 to 64 bytes"),
        ("RETRIEVE", payload_of(RETRIEVE, key=[b"", b"", [[0, 8, b"d" * 65]]]), "digest must be 1 to 64"),
        (
            "STORE",
            payload_of(STORE, key=[b"", b"", [[0, 8, b"a"], [4, 12, b"b"]]]),
            r"STORE.key.spans\[1\]: starts at 4, inside or before the span before it \(ends 8\)",
        ),
        (
            "STORE",
            payload_of(STORE, key=[b"", b"", [[0, 1, b"a"]] * 65537]),
            "STORE.key.spans: 65537 spans exceeds the limit of 65536",
        ),
        ("STORE", payload_of(STORE, block_ids="ab"), "STORE.block_ids: expected bytes"),
        ("STORE", payload_of(STORE, token_ids=b"\x00" * 6), "STORE.token_ids: 6 bytes is not a whole number"),
        ("STORE", payload_of(STORE, block_ids=b"\x00" * 3), "STORE.block_ids: 3 bytes is not a whole number"),
        ("STORE", payload_of(STORE, instance_id=-7), r"STORE.instance_id: -7 is out of range \[0, 2\^63\)"),
        ("STORE", payload_of(STORE, instance_id=1 << 63), r"STORE.instance_id: .* is out of range"),
        ("RETRIEVE", [*m.encode_payload(RETRIEVE), b""], "RETRIEVE: expected 5 payload fields"),
        (
            "RETRIEVE",
            payload_of(RETRIEVE, instance_id="1"),
            "RETRIEVE.instance_id: expected an integer, got str",
        ),
        (
            "RETRIEVE",
            payload_of(RETRIEVE, instance_id=(1 << 64) - 1),
            "RETRIEVE.instance_id: .* is out of range",
        ),
        ("LOOKUP", [IID, S], r"LOOKUP: expected 4 payload fields \(instance_id, secret, token_ids, key\)"),
        ("LOOKUP", payload_of(LOOKUP, token_ids=b"\x01"), "LOOKUP.token_ids: 1 bytes is not a whole number"),
        ("LOOKUP", payload_of(LOOKUP, token_ids=None), "LOOKUP.token_ids: expected bytes"),
        ("LOOKUP", payload_of(LOOKUP, instance_id=True), "LOOKUP.instance_id: expected an integer, got bool"),
    ],
)
def test_payload_validation(mtype: str, payload: Any, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as exc:
        decode(mtype, payload)
    assert exc.value.code == "BAD_REQUEST"


def test_too_many_tokens() -> None:
    n = m.MAX_TOKENS_PER_REQUEST + 1
    with pytest.raises(ProtocolError, match=f"LOOKUP.token_ids: {n} ids exceeds the limit"):
        decode("LOOKUP", payload_of(LOOKUP, token_ids=b"\x00" * (4 * n)))


class TestRegister:
    def test_valid_shm(self) -> None:
        reg = decode("REGISTER_KV_CACHE", shm_register()).payload
        assert isinstance(reg, m.Register)
        assert reg.instance_id == IID and reg.model_name == "m"
        assert reg.secret == SECRET
        assert reg.world_size == 2 and reg.worker_id == 1
        assert reg.memory is m.MemoryKind.SHM
        assert reg.kv_shape == (2, 64, 16, 2, 8)
        assert reg.layers[1] == m.ShmLayer("kvwarden-1-0123456789abcdef", 32768, (16384, 256, 16, 8, 1))

    def test_valid_cuda(self) -> None:
        reg = decode("REGISTER_KV_CACHE", shm_register(memory="cuda_ipc", layers=[cuda_layer()])).payload
        assert isinstance(reg, m.Register)
        assert reg.memory is m.MemoryKind.CUDA_IPC
        layer = reg.layers[0]
        assert isinstance(layer, m.CudaLayer)
        assert layer.ipc_handle == b"h" * 64 and layer.event_sync_required is True

    @pytest.mark.parametrize(
        ("over", "message"),
        [
            ({"instance_id": -1}, r"REGISTER_KV_CACHE.instance_id: -1 is out of range"),
            ({"instance_id": 1 << 63}, "REGISTER_KV_CACHE.instance_id: .* is out of range"),
            ({"secret": b"s" * 15}, r"REGISTER_KV_CACHE.secret: 15 bytes is outside \[16, 64\]"),
            ({"secret": None}, "REGISTER_KV_CACHE.secret: expected bytes, got NoneType"),
            ({"model_name": ""}, "REGISTER_KV_CACHE.model_name: length 0"),
            ({"model_name": 5}, "REGISTER_KV_CACHE.model_name: expected a string"),
            ({"world_size": 0}, r"REGISTER_KV_CACHE.world_size: 0 is out of range"),
            ({"worker_id": -1}, r"REGISTER_KV_CACHE.worker_id: -1 is out of range"),
            ({"worker_id": 2}, "REGISTER_KV_CACHE.worker_id: 2 must be < world_size 2"),
            ({"transfer_mode": "engine"}, "REGISTER_KV_CACHE.transfer_mode: 'engine' is not one"),
            ({"memory": "disk"}, "REGISTER_KV_CACHE.memory: 'disk' is not one of shm, cuda_ipc"),
            ({"dtype": "float64"}, "REGISTER_KV_CACHE.dtype: 'float64' is not one of"),
            ({"kv_shape": [2, 64, 16, 2]}, r"REGISTER_KV_CACHE.kv_shape: expected 5 items, got 4"),
            ({"kv_shape": [2, 0, 16, 2, 8]}, r"REGISTER_KV_CACHE.kv_shape\[1\]: 0 is out of range"),
            ({"kv_shape": [3, 64, 16, 2, 8]}, r"kv_shape\[0\]: must be 2 \(K and V\), got 3"),
            ({"owner_pid": -3}, r"REGISTER_KV_CACHE.owner_pid: -3 is out of range"),
            ({"layers": []}, r"REGISTER_KV_CACHE.layers: 0 layers is outside \[1, 1024\]"),
            (
                {"layers": [["kvwarden-1-0123456789abcdef", 0, [1, 1, 1, 1, 1]]] * 1025},
                r"REGISTER_KV_CACHE.layers: 1025 layers is outside \[1, 1024\]",
            ),
            ({"layers": "seg"}, "REGISTER_KV_CACHE.layers: expected an array, got str"),
            ({"layers": [["seg", 0]]}, r"REGISTER_KV_CACHE.layers\[0\]: expected 3 payload"),
            (
                {"layers": [["seg", -1, [1, 1, 1, 1, 1]]]},
                r"REGISTER_KV_CACHE.layers\[0\].offset: -1 is out of range",
            ),
            (
                {"layers": [["seg", 0, [1, 1, 1, 1]]]},
                r"REGISTER_KV_CACHE.layers\[0\].strides: expected 5 items",
            ),
            (
                {"layers": [["seg", 0, [1, 1, 1, 1, -1]]]},
                r"REGISTER_KV_CACHE.layers\[0\].strides\[4\]: -1 is out of range",
            ),
            (
                {"memory": "cuda_ipc", "layers": [cuda_layer(ipc_handle=b"x" * 1025)]},
                r"layers\[0\].ipc_handle: 1025 bytes exceeds the limit of 1024",
            ),
            (
                {"memory": "cuda_ipc", "layers": [cuda_layer(event_sync_required=1)]},
                r"layers\[0\].event_sync_required: expected a boolean",
            ),
            (
                {"memory": "cuda_ipc", "layers": [cuda_layer()[:5]]},
                r"layers\[0\]: expected 11 payload fields",
            ),
            (
                {"memory": "cuda_ipc", "layers": [["seg", 0, [1, 1, 1, 1, 1]]]},
                r"layers\[0\]: expected 11 payload fields",
            ),
        ],
    )
    def test_invalid(self, over: dict[str, Any], message: str) -> None:
        with pytest.raises(ProtocolError, match=message):
            decode("REGISTER_KV_CACHE", shm_register(**over))

    def test_wrong_arity(self) -> None:
        with pytest.raises(ProtocolError, match="REGISTER_KV_CACHE: expected 11 payload fields"):
            decode("REGISTER_KV_CACHE", shm_register()[:-1])


# ---------------------------------------------------------------------------- secrets


def type_name(msg: m.Message) -> str:
    return type(msg).__name__


class TestSecret:
    """Every message about an instance carries its secret: 16 to 64 bytes, right after the id."""

    def test_bounds(self) -> None:
        assert m.SECRET_BYTES == (16, 64)

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=type_name)
    @pytest.mark.parametrize("size", [16, 17, 63, 64])
    def test_accepts_16_to_64_bytes(self, msg: m.Message, size: int) -> None:
        secret = bytes(range(size))
        req = decode(msg.TYPE, payload_of(msg, secret=secret))
        assert req.payload.secret == secret  # type: ignore[attr-defined]

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=type_name)
    @pytest.mark.parametrize("size", [0, 1, 15, 65, 1024])
    def test_rejects_a_secret_outside_16_to_64_bytes(self, msg: m.Message, size: int) -> None:
        with pytest.raises(
            ProtocolError, match=rf"^{msg.TYPE}\.secret: {size} bytes is outside \[16, 64\]$"
        ) as exc:
            decode(msg.TYPE, payload_of(msg, secret=b"s" * size))
        assert exc.value.code == "BAD_REQUEST"

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=type_name)
    @pytest.mark.parametrize("secret", ["s" * 16, 16, 1.5, True, [0] * 16, {"s": 1}])
    def test_rejects_a_secret_that_is_not_bytes(self, msg: m.Message, secret: Any) -> None:
        with pytest.raises(
            ProtocolError, match=rf"^{msg.TYPE}\.secret: expected bytes, got {type(secret).__name__}$"
        ) as exc:
            decode(msg.TYPE, payload_of(msg, secret=secret))
        assert exc.value.code == "BAD_REQUEST"

    @pytest.mark.parametrize(
        "msg", [x for x in INSTANCE_MESSAGES if not isinstance(x, m.Ping)], ids=type_name
    )
    def test_a_secret_is_required(self, msg: m.Message) -> None:
        """None is a secret only in a probe PING."""
        with pytest.raises(ProtocolError, match=rf"^{msg.TYPE}\.secret: expected bytes, got NoneType$"):
            decode(msg.TYPE, payload_of(msg, secret=None))

    @pytest.mark.parametrize("msg", INSTANCE_MESSAGES, ids=type_name)
    def test_a_missing_secret_field_is_a_wrong_field_count(self, msg: m.Message) -> None:
        """A payload laid out as in v1 (no secret): the count names the secret among the fields."""
        names = m.field_names(type(msg))
        assert names[:2] == ("instance_id", "secret")
        v1_payload = m.encode_payload(msg)
        del v1_payload[names.index("secret")]
        expected = (
            f"{msg.TYPE}: expected {len(names)} payload fields ({', '.join(names)}), got {len(names) - 1}"
        )
        with pytest.raises(ProtocolError) as exc:
            decode(msg.TYPE, v1_payload)
        assert str(exc.value) == expected
        assert exc.value.code == "BAD_REQUEST"

    def test_ping_probe_has_neither_id_nor_secret(self) -> None:
        assert decode("PING", [None, None]).payload == m.Ping(None, None)

    @pytest.mark.parametrize(
        "payload", [[IID, None], [None, SECRET]], ids=["id-without-secret", "secret-without-id"]
    )
    def test_ping_needs_both_id_and_secret_or_neither(self, payload: list[Any]) -> None:
        with pytest.raises(
            ProtocolError, match=r"^PING\.secret: must be given with an instance_id, and only then$"
        ) as exc:
            decode("PING", payload)
        assert exc.value.code == "BAD_REQUEST"

    def test_ping_secret_is_checked_even_without_an_id(self) -> None:
        with pytest.raises(ProtocolError, match=r"^PING\.secret: 15 bytes is outside \[16, 64\]$"):
            decode("PING", [None, b"s" * 15])
        with pytest.raises(ProtocolError, match=r"^PING\.secret: expected bytes, got str$"):
            decode("PING", [IID, "s" * 16])

    def test_field_checks_run_in_wire_order(self) -> None:
        """A bad id and a bad secret: the id (index 0) is named, then the secret (index 1)."""
        with pytest.raises(ProtocolError, match=r"^STORE\.instance_id: "):
            decode("STORE", payload_of(STORE, instance_id=-1, secret=b""))
        with pytest.raises(ProtocolError, match=r"^STORE\.secret: "):
            decode("STORE", payload_of(STORE, secret=b"", token_ids=None))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_secret_length_property(secret: bytes) -> None:
    """Any bytes of 16 to 64 are a secret (kept as sent); any other length is refused."""
    payload = payload_of(UNREG, secret=secret)
    if 16 <= len(secret) <= 64:
        assert decode("UNREGISTER_KV_CACHE", payload).payload == m.Unregister(IID, secret)
    else:
        with pytest.raises(ProtocolError, match=r"UNREGISTER_KV_CACHE\.secret: .* is outside \[16, 64\]"):
            decode("UNREGISTER_KV_CACHE", payload)


# -------------------------------------------------------------------------------- fuzzing


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_protocol_errors(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        roundtrip(data, 4096)


_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=12),
)
_values = st.recursive(_scalars, lambda c: st.lists(c, max_size=6), max_leaves=20)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([t.value for t in m.MsgType]), _values, st.integers(0, 2))
def test_random_payloads_only_raise_protocol_errors(mtype: str, payload: Any, v: int) -> None:
    with contextlib.suppress(ProtocolError):
        roundtrip(msgpack.packb([v, 1, mtype, payload], use_bin_type=True), 1 << 20)


@pytest.mark.parametrize("field", ["transfer_mode", "memory", "dtype"])
def test_a_value_nested_a_thousand_deep_is_refused_naming_the_field(field: str) -> None:
    """The error message shows a bounded repr: a deep value cannot exhaust the stack."""
    deep: Any = None
    for _ in range(1000):
        deep = [deep]
    payload = shm_register(**{field: deep})
    with pytest.raises(
        ProtocolError, match=rf"^REGISTER_KV_CACHE\.{field}: \[\[\[\.\.\.\]\]\] is not one of"
    ):
        decode("REGISTER_KV_CACHE", payload)
