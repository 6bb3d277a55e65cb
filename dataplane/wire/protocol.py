"""The kvwarden wire protocol: msgpack frames, versioned, typed and validated at the edge.

Request  = msgpack ``[version, request_id, type, payload]``  (payload: a msgpack array)
Reply    = msgpack ``[version, request_id, ok, body]``
           ``body`` is the map of the reply record that answers the request (`dataplane.wire.table`)
           when ``ok`` is true, else an ``ErrorReply``'s: ``{"code": str, "message": str}``.

A DEALER client sends one frame per request; a REQ client's empty delimiter frame is accepted too.
Nothing on the wire is pickled: token and block ids travel as little-endian int32 arrays in
msgpack ``bin`` fields, everything else as msgpack scalars, arrays and maps. The payloads are
the records of `dataplane.wire.messages`. See docs/protocol.md for every message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from dataplane.wire.checks import U64_LIMIT, type_name
from dataplane.wire.errors import FrameTooLarge, KVWardenError, ProtocolError, VersionMismatch
from dataplane.wire.messages import Message, MsgType, encode_payload
from dataplane.wire.records import Reply, reply_to_wire
from dataplane.wire.replies import MAX_ERROR_CHARS, ErrorReply
from dataplane.wire.table import PARSERS

# 2: every request of an instance carries its secret; 3: ENGINE_REGISTER names its KV format and block
# size; 4: every message that names tokens carries their key context (salt, adapter, spans); 5: every
# reply is a typed record with exactly its declared fields (ENGINE_REGISTER's `arena` is nil, not
# absent, without an arena), checked by the client; 6: lookups answer the tokens being stored
# (pending_tokens), ENGINE_COMMIT may publish part of a lease (count), LOOKUP_WAITED; 7: STORE,
# ENGINE_STORE and ENGINE_RESERVE end with `blocks`, the engine's names of the blocks (KV events);
# 8: PREFETCH_SCOPE; 9: CLEAR_SCOPE; 10: ENGINE_REGISTER, LOOKUP_SCOPE, PREFETCH_SCOPE and CLEAR_SCOPE
# end with `kv_codec` (int8 chunks)
PROTOCOL_VERSION = 10
DEFAULT_MAX_FRAME_BYTES = 16 << 20

# The liveness contract both sides size themselves against: the server's reap timeout is never
# below this floor, and a worker should PING at least three times within it.
REAP_TIMEOUT_FLOOR_S = 30.0
DEFAULT_HEARTBEAT_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class Request:
    request_id: int
    type: MsgType
    payload: Message[Any]


def peek_request_id(raw: Any) -> int:
    """Best-effort request id of a frame that failed to decode (0 when there is none)."""
    if isinstance(raw, list) and len(raw) >= 2 and type(raw[1]) is int and 0 <= raw[1] < U64_LIMIT:
        return int(raw[1])
    return 0


def unpack(data: bytes | memoryview, max_frame_bytes: int) -> Any:
    if len(data) > max_frame_bytes:
        raise FrameTooLarge(f"frame of {len(data)} bytes exceeds the limit of {max_frame_bytes} bytes")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"undecodable frame ({type(exc).__name__}: {exc})") from None


def decode_request(raw: Any) -> Request:
    """Validate a decoded frame: version first, then id, type and typed payload."""
    if not isinstance(raw, list) or len(raw) != 4:
        n = len(raw) if isinstance(raw, list) else type_name(raw)
        raise ProtocolError(f"request must be [version, request_id, type, payload], got {n} items")
    version, request_id, mtype, payload = raw
    if type(version) is not int:
        raise ProtocolError(f"request.version: expected an integer, got {type_name(version)}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: client speaks v{version}, server speaks v{PROTOCOL_VERSION}"
        )
    if type(request_id) is not int or not 0 <= request_id < U64_LIMIT:
        raise ProtocolError("request.request_id: expected an integer in [0, 2^64)")
    if not isinstance(mtype, str):
        raise ProtocolError(f"request.type: expected a string, got {type_name(mtype)}")
    try:
        msg = MsgType(mtype)
    except ValueError:
        raise ProtocolError(
            f"request.type: unknown message type {mtype[:64]!r}; known: {', '.join(MsgType)}"
        ) from None
    return Request(request_id, msg, PARSERS[msg](payload))


def encode_request(
    request_id: int, mtype: MsgType | str, payload: list[Any], version: int = PROTOCOL_VERSION
) -> bytes:
    """A raw request frame from a positional payload (tests and tools that speak the wire)."""
    data: bytes = msgpack.packb([version, request_id, str(mtype), payload], use_bin_type=True)
    return data


def encode_message(request_id: int, msg: Message[Any]) -> bytes:
    """The request frame of a typed message."""
    return encode_request(request_id, msg.TYPE, encode_payload(msg))


def encode_ok(request_id: int, body: Reply) -> bytes:
    data: bytes = msgpack.packb(
        [PROTOCOL_VERSION, request_id, True, body], use_bin_type=True, default=reply_to_wire
    )
    return data


def encode_error(request_id: int, err: KVWardenError) -> bytes:
    body = ErrorReply(err.code, str(err)[:MAX_ERROR_CHARS])
    data: bytes = msgpack.packb(
        [PROTOCOL_VERSION, request_id, False, body], use_bin_type=True, default=reply_to_wire
    )
    return data


@dataclass(frozen=True, slots=True)
class ReplyFrame:
    """A reply as it arrived: ``body`` still a map (`dataplane.wire.table.decode_body` types it)."""

    request_id: int
    ok: bool
    body: Any


def decode_reply(data: bytes) -> ReplyFrame:
    raw = msgpack.unpackb(data, raw=False)
    if not isinstance(raw, list) or len(raw) != 4:
        raise ProtocolError("malformed reply")
    version, request_id, ok, body = raw
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: server speaks v{version}, client speaks v{PROTOCOL_VERSION}"
        )
    return ReplyFrame(int(request_id), bool(ok), body)
