"""`dataplane.wire.protocol`: framing, the request envelope, protocol versions and replies,
and random frames and payloads, which only ever raise a `ProtocolError`."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataplane.wire import checks as c
from dataplane.wire import messages as m
from dataplane.wire import protocol as p
from dataplane.wire.errors import FrameTooLarge, ProtocolError, ShuttingDown, VersionMismatch
from tests.dataplane.registration import SECRET
from tests.dataplane.wire.payloads import IID, INSTANCE_MESSAGES, V, decode, roundtrip


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
            None,  # no engine names of the blocks
        ]
        names = m.EngineBlocks(16, (1, b"h" * 32), "lora-a", ((1, "x"), None))
        got = roundtrip(
            p.encode_message(5, m.Store(IID, SECRET, np.arange(40), np.array([3, 1, 2]), None, names))
        )
        assert got.payload.blocks == names
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

    def test_protocol_version_is_10(self) -> None:
        assert p.PROTOCOL_VERSION == 10

    def test_version_mismatch_names_both_versions(self) -> None:
        with pytest.raises(VersionMismatch) as exc:
            roundtrip(p.encode_request(1, "HELLO", [], version=3))
        msg = str(exc.value)
        assert "v3" in msg and f"v{p.PROTOCOL_VERSION}" in msg
        assert "client speaks v3" in msg and "server speaks v10" in msg
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
        assert "client speaks v1, server speaks v10" in str(exc.value)
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
        data = msgpack.packb([11, 1, True, None])
        with pytest.raises(VersionMismatch, match="server speaks v11, client speaks v10"):
            p.decode_reply(data)
        with pytest.raises(VersionMismatch, match="server speaks v1, client speaks v10"):
            p.decode_reply(msgpack.packb([1, 1, True, None]))
        with pytest.raises(ProtocolError, match="malformed reply"):
            p.decode_reply(msgpack.packb([1, 1, True]))


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
