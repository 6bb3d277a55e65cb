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

IID = 123456789


def raw(version: Any, rid: Any, mtype: Any, payload: Any) -> list[Any]:
    return [version, rid, mtype, payload]


def decode(mtype: str, payload: Any, rid: int = 7) -> p.Request:
    return p.decode_request(raw(p.PROTOCOL_VERSION, rid, mtype, payload))


def roundtrip(frame: bytes, limit: int = p.DEFAULT_MAX_FRAME_BYTES) -> p.Request:
    return p.decode_request(p.unpack(frame, limit))


def shm_register(**over: Any) -> list[Any]:
    vals: dict[str, Any] = {
        "instance_id": IID,
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
    return list(vals.values())


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
    return list(vals.values())


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
        assert roundtrip(p.encode_request(2, m.MsgType.PING, [None])).payload == m.Ping(None)
        assert roundtrip(p.encode_request(2, m.MsgType.PING, [IID])).payload == m.Ping(IID)
        assert roundtrip(p.encode_request(3, "UNREGISTER_KV_CACHE", [IID])).payload == m.Unregister(IID)
        for mtype in (m.MsgType.STORE, m.MsgType.RETRIEVE):
            req = roundtrip(p.encode_request(9, mtype, [IID, tok, blk]))
            assert req.request_id == 9 and req.type is mtype
            assert isinstance(req.payload, m.Transfer)
            assert req.payload.instance_id == IID
            assert req.payload.token_ids.tolist() == list(range(40))
            assert req.payload.block_ids.tolist() == [3, 1, 2]
        req = roundtrip(p.encode_request(4, m.MsgType.LOOKUP, [IID, tok]))
        assert isinstance(req.payload, m.Lookup)
        assert req.payload.token_ids.tolist() == list(range(40))

    def test_request_id_full_u64_range(self) -> None:
        assert roundtrip(p.encode_request((1 << 64) - 1, "HELLO", [])).request_id == (1 << 64) - 1
        with pytest.raises(ProtocolError, match=r"request_id: expected an integer in \[0, 2\^64\)"):
            p.decode_request([1, -1, "HELLO", []])
        with pytest.raises(ProtocolError, match="request_id"):
            p.decode_request([1, "7", "HELLO", []])

    def test_frame_too_large(self) -> None:
        frame = p.encode_request(1, m.MsgType.LOOKUP, [IID, c.ids_to_bytes(range(2000))])
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

    def test_version_mismatch_names_both_versions(self) -> None:
        with pytest.raises(VersionMismatch) as exc:
            roundtrip(p.encode_request(1, "HELLO", [], version=2))
        msg = str(exc.value)
        assert "v2" in msg and f"v{p.PROTOCOL_VERSION}" in msg
        assert "client speaks v2" in msg and "server speaks v1" in msg
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
        assert r == p.Reply(5, True, {"hit_tokens": 32})
        r = p.decode_reply(p.encode_error(6, FrameTooLarge("too big")))
        assert r == p.Reply(6, False, {"code": "FRAME_TOO_LARGE", "message": "too big"})
        r = p.decode_reply(p.encode_error(7, ShuttingDown("server is stopping")))
        assert r.body == {"code": "SHUTTING_DOWN", "message": "server is stopping"}

    def test_reply_version_mismatch_names_both(self) -> None:
        data = msgpack.packb([9, 1, True, None])
        with pytest.raises(VersionMismatch, match="server speaks v9, client speaks v1"):
            p.decode_reply(data)
        with pytest.raises(ProtocolError, match="malformed reply"):
            p.decode_reply(msgpack.packb([1, 1, True]))


# ----------------------------------------------------------------------- payload parsers


@pytest.mark.parametrize(
    ("mtype", "payload", "message"),
    [
        ("HELLO", [1], r"HELLO: expected 0 payload fields \(nothing\), got 1"),
        ("HELLO", None, "HELLO: payload must be an array, got NoneType"),
        ("GET_SERVER_INFO", [None], "GET_SERVER_INFO: expected 0 payload fields"),
        ("PING", [], r"PING: expected 1 payload fields \(instance_id\), got 0"),
        ("PING", [1, 2], r"PING: expected 1 payload fields \(instance_id\), got 2"),
        ("PING", ["x"], "PING.instance_id: expected an integer, got str"),
        ("PING", [1.5], "PING.instance_id: expected an integer, got float"),
        ("PING", [-1], r"PING.instance_id: -1 is out of range \[0, 2\^63\)"),
        ("PING", [1 << 63], r"PING.instance_id: 9223372036854775808 is out of range"),
        ("UNREGISTER_KV_CACHE", [None], "UNREGISTER_KV_CACHE.instance_id: expected an integer"),
        ("UNREGISTER_KV_CACHE", [], r"UNREGISTER_KV_CACHE: expected 1 payload fields"),
        (
            "STORE",
            [IID, b""],
            r"STORE: expected 3 payload fields \(instance_id, token_ids, "
            r"block_ids\), got 2",
        ),
        ("STORE", [IID, [1, 2], b""], "STORE.token_ids: expected bytes"),
        ("STORE", [IID, b"", "ab"], "STORE.block_ids: expected bytes"),
        ("STORE", [IID, b"\x00" * 6, b""], "STORE.token_ids: 6 bytes is not a whole number"),
        ("STORE", [IID, b"", b"\x00" * 3], "STORE.block_ids: 3 bytes is not a whole number"),
        ("STORE", [-7, b"", b""], r"STORE.instance_id: -7 is out of range \[0, 2\^63\)"),
        ("STORE", [1 << 63, b"", b""], r"STORE.instance_id: .* is out of range"),
        ("RETRIEVE", [IID, b"", b"", b""], "RETRIEVE: expected 3 payload fields"),
        ("RETRIEVE", ["1", b"", b""], "RETRIEVE.instance_id: expected an integer, got str"),
        ("RETRIEVE", [(1 << 64) - 1, b"", b""], "RETRIEVE.instance_id: .* is out of range"),
        ("LOOKUP", [IID], r"LOOKUP: expected 2 payload fields \(instance_id, token_ids\)"),
        ("LOOKUP", [IID, b"\x01"], "LOOKUP.token_ids: 1 bytes is not a whole number"),
        ("LOOKUP", [IID, None], "LOOKUP.token_ids: expected bytes"),
        ("LOOKUP", [True, b""], "LOOKUP.instance_id: expected an integer, got bool"),
    ],
)
def test_payload_validation(mtype: str, payload: Any, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as exc:
        decode(mtype, payload)
    assert exc.value.code == "BAD_REQUEST"


def test_too_many_tokens() -> None:
    n = m.MAX_TOKENS_PER_REQUEST + 1
    with pytest.raises(ProtocolError, match=f"LOOKUP.token_ids: {n} ids exceeds the limit"):
        decode("LOOKUP", [IID, b"\x00" * (4 * n)])


class TestRegister:
    def test_valid_shm(self) -> None:
        reg = decode("REGISTER_KV_CACHE", shm_register()).payload
        assert isinstance(reg, m.Register)
        assert reg.instance_id == IID and reg.model_name == "m"
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
        with pytest.raises(ProtocolError, match="REGISTER_KV_CACHE: expected 10 payload fields"):
            decode("REGISTER_KV_CACHE", shm_register()[:-1])


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
