"""Bad input against a real server process: every bad frame gets an error reply naming the
problem, and the server keeps answering."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.wire.checks import ids_to_bytes
from dataplane.wire.errors import NotRegistered, RequestError
from dataplane.wire.messages import CudaLayer, MemoryKind, Register, ShmLayer, encode_payload, field_names
from dataplane.wire.protocol import decode_reply, encode_request
from tests.helpers import ServerProcess, call, error_of, next_rid, ping, request

MAX_FRAME = 65536
CHUNK = 32
LAYOUT = dict(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)

Sock = zmq.Socket[Any]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("bad-input"),
        "--max-frame-bytes",
        str(MAX_FRAME),
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "0.01",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        rc = srv.stop()
        assert rc == 0, f"server exited {rc}:\n{srv.output()}"
        assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def worker(server: ServerProcess) -> Iterator[tuple[WorkerAdapter, list[torch.Tensor]]]:
    caches = allocate_kv_caches(**LAYOUT)  # type: ignore[arg-type]
    for c in caches:
        c.copy_(torch.randn(c.shape).to(c.dtype))
    w = WorkerAdapter(server.endpoint, model_name="bad-input", request_timeout=10.0)
    w.register_kv_caches(caches)
    yield w, caches
    w.close()


@pytest.fixture
def sock(server: ServerProcess, make_dealer: Callable[[str], Sock]) -> Sock:
    return make_dealer(server.endpoint)


def expect_error(sock: Sock, frame: bytes | list[bytes], code: str, *parts: str) -> str:
    """The reply is an error with ``code`` whose message holds every part; PING still answers."""
    reply = call(sock, frame)
    got_code, message = error_of(reply)
    assert got_code == code, (got_code, message)
    for part in parts:
        assert part in message, (part, message)
    ping(sock)  # the server still answers, on the same connection
    return message


def frame(mtype: str, payload: Any, rid: int | None = None, version: int = 1) -> bytes:
    return encode_request(next_rid() if rid is None else rid, mtype, payload, version=version)


def test_server_info(server: ServerProcess, sock: Sock) -> None:
    reply = call(sock, frame("HELLO", []))
    assert reply.ok
    assert reply.body["protocol_version"] == 1
    assert reply.body["chunk_size"] == CHUNK
    assert reply.body["max_frame_bytes"] == MAX_FRAME


@pytest.mark.parametrize("cut", [1, 3, 10])
def test_truncated_msgpack(sock: Sock, cut: int) -> None:
    data = frame("LOOKUP", [1, ids_to_bytes(range(10))])
    msg = expect_error(sock, data[:-cut], "BAD_REQUEST", "undecodable frame")
    assert len(msg) < 300


def test_garbage_bytes(sock: Sock) -> None:
    expect_error(sock, b"\xc1\xc1\xc1", "BAD_REQUEST", "undecodable frame")


def test_deeply_nested_frames(sock: Sock) -> None:
    expect_error(sock, b"\x91" * 60_000 + b"\xc0", "BAD_REQUEST", "undecodable frame")
    nested = b"\x94\x01\x05\xa4PING\x91" + b"\x91" * 500 + b"\xc0"  # [1, 5, "PING", [[[...]]]]
    expect_error(sock, nested, "BAD_REQUEST", "PING.instance_id", "got list")


def test_not_an_array(sock: Sock) -> None:
    expect_error(
        sock,
        msgpack.packb({"version": 1}),
        "BAD_REQUEST",
        "request must be [version, request_id, type, payload]",
    )


def test_wrong_version(sock: Sock) -> None:
    rid = next_rid()
    reply = call(sock, frame("PING", [None], rid=rid, version=7))
    code, message = error_of(reply)
    assert code == "VERSION_MISMATCH"
    assert "v7" in message and "v1" in message
    assert reply.request_id == rid  # the id is echoed even on a decode error
    ping(sock)


def test_unknown_message_type(sock: Sock) -> None:
    rid = next_rid()
    reply = call(sock, frame("TELEPORT", [], rid=rid))
    code, message = error_of(reply)
    assert code == "BAD_REQUEST" and "unknown message type 'TELEPORT'" in message
    assert reply.request_id == rid
    ping(sock)


@pytest.mark.parametrize(
    ("mtype", "payload", "parts"),
    [
        ("PING", [], ["PING: expected 1 payload fields", "got 0"]),
        ("PING", [1, 2, 3], ["PING: expected 1 payload fields", "got 3"]),
        ("HELLO", [1], ["HELLO: expected 0 payload fields"]),
        ("STORE", [1, b""], ["STORE: expected 3 payload fields", "got 2"]),
        ("LOOKUP", [1, b"", b"", b""], ["LOOKUP: expected 2 payload fields"]),
        ("REGISTER_KV_CACHE", [1, "m"], ["REGISTER_KV_CACHE: expected 10 payload fields"]),
        ("RETRIEVE", "not a list", ["RETRIEVE: payload must be an array"]),
    ],
)
def test_wrong_arity(sock: Sock, mtype: str, payload: Any, parts: list[str]) -> None:
    expect_error(sock, frame(mtype, payload), "BAD_REQUEST", *parts)


@pytest.mark.parametrize(
    ("mtype", "payload", "parts"),
    [
        ("PING", ["me"], ["PING.instance_id", "expected an integer, got str"]),
        ("PING", [1.0], ["PING.instance_id", "got float"]),
        ("PING", [True], ["PING.instance_id", "got bool"]),
        ("LOOKUP", [1, [1, 2, 3]], ["LOOKUP.token_ids", "expected bytes"]),
        ("STORE", [1, b"", "blocks"], ["STORE.block_ids", "expected bytes"]),
        ("UNREGISTER_KV_CACHE", [[1]], ["UNREGISTER_KV_CACHE.instance_id", "got list"]),
    ],
)
def test_wrong_types(sock: Sock, mtype: str, payload: Any, parts: list[str]) -> None:
    expect_error(sock, frame(mtype, payload), "BAD_REQUEST", *parts)


def test_wrong_type_of_request_fields(sock: Sock) -> None:
    expect_error(sock, msgpack.packb([1, 1, 5, []]), "BAD_REQUEST", "request.type", "expected a string")
    expect_error(sock, msgpack.packb([1, "id", "PING", [None]]), "BAD_REQUEST", "request.request_id")
    expect_error(
        sock,
        msgpack.packb(["1", 1, "PING", [None]]),
        "BAD_REQUEST",
        "request.version",
        "expected an integer",
    )


@pytest.mark.parametrize("iid", [-1, -(1 << 63), 1 << 63, (1 << 64) - 1])
@pytest.mark.parametrize("mtype", ["PING", "LOOKUP", "STORE", "UNREGISTER_KV_CACHE"])
def test_out_of_range_instance_id(sock: Sock, mtype: str, iid: int) -> None:
    payload = {
        "PING": [iid],
        "LOOKUP": [iid, b""],
        "STORE": [iid, b"", b""],
        "UNREGISTER_KV_CACHE": [iid],
    }[mtype]
    expect_error(
        sock,
        frame(mtype, payload),
        "BAD_REQUEST",
        f"{mtype}.instance_id",
        str(iid),
        "out of range [0, 2^63)",
    )


@pytest.mark.parametrize("n", [1, 5, 4 * CHUNK + 2])
def test_id_array_not_whole_int32(sock: Sock, n: int) -> None:
    expect_error(
        sock,
        frame("LOOKUP", [1, b"\x00" * n]),
        "BAD_REQUEST",
        "LOOKUP.token_ids",
        f"{n} bytes is not a whole number of int32 ids",
    )
    expect_error(
        sock,
        frame("STORE", [1, b"", b"\x00" * n]),
        "BAD_REQUEST",
        "STORE.block_ids",
        "not a whole number",
    )


def test_frame_over_the_size_limit(sock: Sock) -> None:
    big = frame("LOOKUP", [1, b"\x00" * 69_984])
    assert len(big) >= 70_000
    msg = expect_error(sock, big, "FRAME_TOO_LARGE", f"{len(big)} bytes", str(MAX_FRAME))
    assert "exceeds the limit" in msg
    assert len(msg) < 300


def test_plain_bytes_over_the_size_limit(sock: Sock) -> None:
    expect_error(sock, b"\x00" * 70_000, "FRAME_TOO_LARGE", "70000 bytes", str(MAX_FRAME))


def test_frame_just_under_the_limit_is_decoded(sock: Sock) -> None:
    data = frame("LOOKUP", [1, b"\x00" * (MAX_FRAME - 64)])
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
    frames = request(sock, [b"", frame("PING", [None], rid=rid)])
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


# ------------------------------------------------------------- against a registered cache


def tokens(n: int, seed: int = 0) -> bytes:
    return ids_to_bytes(np.random.default_rng(seed).integers(0, 30_000, n))


@pytest.mark.parametrize(
    ("blocks", "bad_index", "bad_block"),
    [([0, 64], 1, 64), ([-1, 3], 0, -1), ([5, 1 << 30], 1, 1 << 30)],
)
def test_store_with_blocks_outside_the_cache(
    sock: Sock,
    worker: tuple[WorkerAdapter, list[torch.Tensor]],
    blocks: list[int],
    bad_index: int,
    bad_block: int,
) -> None:
    w, _ = worker
    expect_error(
        sock,
        frame("STORE", [w.instance_id, tokens(2 * 16, seed=bad_index), ids_to_bytes(blocks)]),
        "REQUEST_REFUSED",
        f"block_ids[{bad_index}]",
        f"block {bad_block}",
        "outside the registered cache [0, 64)",
    )
    assert w.lookup(np.frombuffer(tokens(2 * 16, seed=bad_index), dtype="<i4")) == 0


def test_store_with_too_few_blocks(sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]) -> None:
    w, _ = worker
    expect_error(
        sock,
        frame("STORE", [w.instance_id, tokens(2 * CHUNK), ids_to_bytes([1, 2])]),
        "REQUEST_REFUSED",
        "2 blocks cannot hold 64 tokens",
    )


def test_retrieve_into_blocks_outside_the_cache(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]
) -> None:
    w, caches = worker
    toks = np.frombuffer(tokens(CHUNK, seed=99), dtype="<i4")
    assert w.store(toks, [3, 4])
    before = [c.clone() for c in caches]  # every block: a refused RETRIEVE writes none
    expect_error(
        sock,
        frame("RETRIEVE", [w.instance_id, toks.tobytes(), ids_to_bytes([7, 64])]),
        "REQUEST_REFUSED",
        "block_ids[1]",
        "outside the registered cache",
    )
    for c, b in zip(caches, before, strict=True):  # bitwise: not even block 7 was written
        assert torch.equal(c.view(torch.int16), b.view(torch.int16))
    assert not all(torch.equal(c[:, 3:5], c[:, 7:9]) for c in caches)
    assert w.retrieve(toks, [7, 8]) == CHUNK  # the stored chunk itself is intact
    for c in caches:
        assert torch.equal(c[:, 3:5], c[:, 7:9])


def test_transfer_for_an_unknown_instance(sock: Sock) -> None:
    for mtype, payload in (
        ("STORE", [424242, tokens(CHUNK), ids_to_bytes([0, 1])]),
        ("RETRIEVE", [424242, tokens(CHUNK), ids_to_bytes([0, 1])]),
        ("LOOKUP", [424242, tokens(CHUNK)]),
    ):
        expect_error(sock, frame(mtype, payload), "NOT_REGISTERED", "instance 424242", "not registered")
    reply = call(sock, frame("UNREGISTER_KV_CACHE", [424242]))
    assert reply.ok and reply.body == {"removed": False}
    assert ping(sock, 424242).body["tracked"] is False


def test_client_raises_typed_errors(worker: tuple[WorkerAdapter, list[torch.Tensor]]) -> None:
    w, _ = worker
    with pytest.raises(RequestError, match="outside the registered cache"):
        w.store(np.arange(CHUNK), [0, 99])
    ghost = WorkerAdapter(w.endpoint, model_name="ghost", request_timeout=10.0)
    try:
        with pytest.raises(NotRegistered, match="not registered"):
            ghost.lookup(np.arange(CHUNK))
    finally:
        ghost.close()


# -------------------------------------------------------------------- bad registrations


def registration(w: WorkerAdapter) -> Register:
    """The worker's own (valid) REGISTER, as the adapter sent it."""
    reg = w.registration
    assert isinstance(reg, Register), reg
    return reg


def register_payload(w: WorkerAdapter, **over: Any) -> list[Any]:
    """The worker's REGISTER payload under a fresh instance id, with the fields in ``over``
    replaced (typed values: the record encodes them as they travel)."""
    reg = dataclasses.replace(registration(w), instance_id=777_000 + len(over), **over)
    return encode_payload(reg)


def instance_of(payload: list[Any]) -> int:
    iid = payload[field_names(Register).index("instance_id")]
    assert isinstance(iid, int)
    return iid


def expect_refused_registration(sock: Sock, payload: list[Any], *parts: str) -> str:
    message = expect_error(sock, frame("REGISTER_KV_CACHE", payload), "INVALID_LAYOUT", *parts)
    assert ping(sock, instance_of(payload)).body["tracked"] is False
    return message


def shm_layers(w: WorkerAdapter) -> list[ShmLayer]:
    layers = registration(w).layers
    assert all(isinstance(lay, ShmLayer) for lay in layers), layers
    return [lay for lay in layers if isinstance(lay, ShmLayer)]


STRIDES = (16384, 256, 16, 8, 1)  # contiguous [2, 64, 16, 2, 8]: the worker's LAYOUT


def test_register_foreign_segment_names(sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]) -> None:
    w, _ = worker
    assert shm_layers(w)[0].strides == STRIDES  # the refusal is about the name alone
    for seg in ("../../etc/passwd", "kvwarden-1-../../x", "notkvwarden"):
        layers = (ShmLayer(segment=seg, offset=0, strides=STRIDES),)
        expect_refused_registration(sock, register_payload(w, layers=layers), "is not a kvwarden segment")


def test_register_missing_segment(sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]) -> None:
    w, _ = worker
    layers = (ShmLayer(segment="kvwarden-1-0123456789abcdef", offset=0, strides=STRIDES),)
    expect_refused_registration(sock, register_payload(w, layers=layers), "does not exist")


def test_register_layout_larger_than_the_segment(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]
) -> None:
    w, _ = worker
    layers = tuple(dataclasses.replace(lay, strides=(65536, 256, 16, 8, 1)) for lay in shm_layers(w))
    expect_refused_registration(
        sock, register_payload(w, kv_shape=(2, 256, 16, 2, 8), layers=layers), "bytes"
    )


def test_register_non_contiguous_strides(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]
) -> None:
    w, _ = worker
    layers = tuple(dataclasses.replace(lay, strides=(1, 1, 1, 1, 1)) for lay in shm_layers(w))
    expect_refused_registration(sock, register_payload(w, layers=layers), "strides", "not contiguous")


def test_register_misaligned_offset(sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]) -> None:
    w, _ = worker
    layers = tuple(dataclasses.replace(lay, offset=lay.offset + 1) for lay in shm_layers(w))
    expect_refused_registration(sock, register_payload(w, layers=layers), "aligned")


def test_register_bogus_cuda_ipc(sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]) -> None:
    w, _ = worker
    layer = CudaLayer(
        device_uuid="GPU-0",
        device_index=0,
        ipc_handle=b"h" * 64,
        storage_nbytes=1 << 20,
        storage_offset=0,
        tensor_offset=0,
        ref_counter_handle=b"r",
        ref_counter_offset=0,
        event_handle=b"e",
        event_sync_required=False,
        strides=STRIDES,
    )
    payload = register_payload(w, memory=MemoryKind.CUDA_IPC, layers=(layer,))
    code, message = error_of(call(sock, frame("REGISTER_KV_CACHE", payload)))
    if not torch.cuda.is_available():
        assert code == "INVALID_LAYOUT" and "CUDA" in message, (code, message)
    assert ping(sock, instance_of(payload)).body["tracked"] is False


def test_registered_worker_still_works(worker: tuple[WorkerAdapter, list[torch.Tensor]]) -> None:
    """After all of the above, the good worker's traffic is served correctly."""
    w, caches = worker
    toks = np.arange(1000, 1000 + 3 * CHUNK)
    blocks = [10, 11, 12, 13, 14, 15]
    assert w.store(toks, blocks)
    assert w.lookup(toks) == 3 * CHUNK
    assert w.retrieve(toks, [40, 41, 42, 43, 44, 45]) == 3 * CHUNK
    for c in caches:
        assert torch.equal(c[:, 10:16], c[:, 40:46])
