"""Bad frames against a real server process: undecodable and oversized frames, the request
envelope, protocol versions and message types. Every bad frame gets an error reply naming the
problem, and the server keeps answering."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from dataplane.client import WorkerAdapter
from dataplane.wire.messages import Lookup
from dataplane.wire.protocol import PROTOCOL_VERSION, decode_reply, encode_message
from tests.dataplane.registration import SECRET
from tests.dataplane.server.wire_client import (
    CHUNK,
    LOOKUP1,
    MAX_FRAME,
    Sock,
    expect_error,
    frame,
    payload_of,
    ping,
    secret_of,
    tokens,
)
from tests.helpers import ServerProcess, call, error_of, next_rid, request


def test_server_info(server: ServerProcess, sock: Sock) -> None:
    reply = call(sock, frame("HELLO", []))
    assert reply.ok
    assert reply.body["protocol_version"] == 10 == PROTOCOL_VERSION
    assert reply.body["chunk_size"] == CHUNK
    assert reply.body["max_frame_bytes"] == MAX_FRAME


@pytest.mark.parametrize("cut", [1, 3, 10])
def test_truncated_msgpack(sock: Sock, cut: int) -> None:
    data = encode_message(next_rid(), Lookup(1, SECRET, np.arange(10)))
    msg = expect_error(sock, data[:-cut], "BAD_REQUEST", "undecodable frame")
    assert len(msg) < 300


def test_garbage_bytes(sock: Sock) -> None:
    expect_error(sock, b"\xc1\xc1\xc1", "BAD_REQUEST", "undecodable frame")


def test_deeply_nested_frames(sock: Sock) -> None:
    expect_error(sock, b"\x91" * 60_000 + b"\xc0", "BAD_REQUEST", "undecodable frame")
    # [2, 5, "PING", [[[...]], None]]: the id (checked first) nested 500 deep, no secret
    nested = b"\x94" + msgpack.packb(PROTOCOL_VERSION) + b"\x05\xa4PING\x92" + b"\x91" * 500 + b"\xc0\xc0"
    assert msgpack.unpackb(nested)[:3] == [PROTOCOL_VERSION, 5, "PING"]
    expect_error(sock, nested, "BAD_REQUEST", "PING.instance_id", "got list")


def test_not_an_array(sock: Sock) -> None:
    expect_error(
        sock,
        msgpack.packb({"version": PROTOCOL_VERSION}),
        "BAD_REQUEST",
        "request must be [version, request_id, type, payload]",
    )


def test_wrong_version(sock: Sock) -> None:
    rid = next_rid()
    reply = call(sock, frame("PING", [None, None], rid=rid, version=11))
    code, message = error_of(reply)
    assert code == "VERSION_MISMATCH"
    assert "v11" in message and "v10" in message
    assert reply.request_id == rid  # the id is echoed even on a decode error
    ping(sock)


def test_v1_client_gets_version_mismatch(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]
) -> None:
    """A v1 client's frames (payloads without a secret) are refused for their version, naming
    both, and change nothing: its UNREGISTER of a live instance leaves it tracked."""
    w, _ = worker
    for mtype, v1_payload in (
        ("HELLO", []),
        ("PING", [None]),
        ("PING", [w.instance_id]),
        ("UNREGISTER_KV_CACHE", [w.instance_id]),
        ("LOOKUP", [w.instance_id, tokens(CHUNK).tobytes()]),
    ):
        rid = next_rid()
        reply = call(sock, frame(mtype, v1_payload, rid=rid, version=1))
        code, message = error_of(reply)
        assert code == "VERSION_MISMATCH", (mtype, code, message)
        assert "client speaks v1" in message and "server speaks v10" in message, message
        assert reply.request_id == rid
    assert ping(sock, w.instance_id, secret_of(w)).body["tracked"] is True


def test_unknown_message_type(sock: Sock) -> None:
    rid = next_rid()
    reply = call(sock, frame("TELEPORT", [], rid=rid))
    code, message = error_of(reply)
    assert code == "BAD_REQUEST" and "unknown message type 'TELEPORT'" in message
    assert reply.request_id == rid
    ping(sock)


def test_wrong_type_of_request_fields(sock: Sock) -> None:
    v = PROTOCOL_VERSION
    expect_error(sock, msgpack.packb([v, 1, 5, []]), "BAD_REQUEST", "request.type", "expected a string")
    expect_error(sock, msgpack.packb([v, "id", "PING", [None, None]]), "BAD_REQUEST", "request.request_id")
    expect_error(
        sock,
        msgpack.packb([str(v), 1, "PING", [None, None]]),
        "BAD_REQUEST",
        "request.version",
        "expected an integer",
    )


def test_frame_over_the_size_limit(sock: Sock) -> None:
    big = frame("LOOKUP", payload_of(LOOKUP1, token_ids=b"\x00" * 69_984))
    assert len(big) >= 70_000
    msg = expect_error(sock, big, "FRAME_TOO_LARGE", f"{len(big)} bytes", str(MAX_FRAME))
    assert "exceeds the limit" in msg
    assert len(msg) < 300


def test_plain_bytes_over_the_size_limit(sock: Sock) -> None:
    expect_error(sock, b"\x00" * 70_000, "FRAME_TOO_LARGE", "70000 bytes", str(MAX_FRAME))


def test_frame_just_under_the_limit_is_decoded(sock: Sock) -> None:
    data = frame("LOOKUP", payload_of(LOOKUP1, token_ids=b"\x00" * (MAX_FRAME - 64)))
    assert len(data) <= MAX_FRAME
    # it passes the size check and fails later, on the unknown instance
    expect_error(sock, data, "NOT_REGISTERED", "instance 1 is not registered")


def test_frame_far_over_the_hard_cap(
    server: ServerProcess, sock: Sock, make_dealer: Callable[[str], Sock]
) -> None:
    """Beyond the socket's hard cap (ZMQ_MAXMSGSIZE, 4x the frame limit here) libzmq drops the
    peer's connection instead of answering, but the server lives on."""
    hard_cap = max(4 * MAX_FRAME, MAX_FRAME + (1 << 20))  # as dataplane.server.loop sets it
    assert hard_cap < 4 << 20
    ping(sock)  # connected, and nothing else in flight on it
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.send(b"\x00" * (4 << 20))
        # the peer itself: the server closes its connection (no FRAME_TOO_LARGE reply, which
        # a frame between the limit and the cap gets)
        assert monitor.poll(10_000, zmq.POLLIN), "the server kept the oversized peer's connection"
        event = recv_monitor_message(monitor)
        assert event["event"] == zmq.EVENT_DISCONNECTED, event
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
    assert sock.poll(0, zmq.POLLIN) == 0  # nothing was answered on the dropped connection
    other = make_dealer(server.endpoint)
    ping(other)  # another peer is served
    # the dropped peer reconnects on a fresh connection and is served again; the first reply
    # it reads is its PING's (ping() checks the id), so no late answer to the huge frame came
    ping(sock)
    assert server.proc.poll() is None


def test_empty_message(sock: Sock) -> None:
    expect_error(sock, [b""], "BAD_REQUEST", "undecodable frame")


def test_empty_multipart_frames(sock: Sock) -> None:
    frames = request(sock, [b"", b""])
    assert frames[0] == b""  # the envelope comes back
    code, message = error_of(decode_reply(frames[-1]))
    assert code == "BAD_REQUEST" and "undecodable" in message
    ping(sock)


def test_req_style_envelope_on_a_dealer(sock: Sock) -> None:
    rid = next_rid()
    frames = request(sock, [b"", frame("PING", [None, None], rid=rid)])
    assert len(frames) == 2 and frames[0] == b""
    reply = decode_reply(frames[1])
    assert reply.ok and reply.request_id == rid
    ping(sock)


def test_req_socket(server: ServerProcess, sock: Sock) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(server.endpoint)
        for _ in range(3):
            rid = next_rid()
            reply = call(req, frame("HELLO", [], rid=rid))
            assert reply.ok and reply.request_id == rid
        bad = call(req, b"\x92")
        assert error_of(bad)[0] == "BAD_REQUEST"
    finally:
        req.close(linger=0)
        ctx.term()
    ping(sock)


def test_many_bad_frames_in_a_burst(sock: Sock) -> None:
    for i in range(300):
        sock.send(b"\xc1" if i % 2 else frame("NOPE", []))
    errors = 0
    while errors < 300:
        assert sock.poll(10_000, zmq.POLLIN), f"only {errors} replies"
        assert decode_reply(sock.recv()).ok is False
        errors += 1
    ping(sock)
