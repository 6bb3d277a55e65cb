"""Bad input against a real server process: every bad frame gets an error reply naming the
problem, and the server keeps answering."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from dataplane.memory.shm import Segment
from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.errors import NotRegistered, RequestError
from dataplane.wire.messages import (
    BlendAcquire,
    BlendRegister,
    BlendReserve,
    BlendRetrieve,
    BlendStore,
    CudaLayer,
    EngineAcquire,
    EngineCommit,
    EngineRegister,
    EngineRelease,
    EngineReserve,
    EngineRetrieve,
    EngineStore,
    Lookup,
    MemoryKind,
    Message,
    MsgType,
    Ping,
    Record,
    Register,
    Retrieve,
    ShmLayer,
    Store,
    Unregister,
    encode_payload,
    field_names,
)
from dataplane.wire.protocol import PROTOCOL_VERSION, ReplyFrame, decode_reply, encode_message, encode_request
from tests.dataplane.registration import SECRET, engine_register_message, register_message
from tests.helpers import ServerProcess, call, error_of, next_rid, request, wait_until

MAX_FRAME = 65536
CHUNK = 32
LAYOUT = dict(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
OTHER = bytes(range(100, 116))  # an attacker's secret: anything but the victim's
NO_IDS = np.zeros(0, dtype=ID_DTYPE)
# valid messages of instance 1 (never registered), for breaking one field at a time
PING1 = Ping(1, SECRET)
UNREG1 = Unregister(1, SECRET)
STORE1 = Store(1, SECRET, NO_IDS, NO_IDS)
LOOKUP1 = Lookup(1, SECRET, NO_IDS)

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


def frame(mtype: str, payload: Any, rid: int | None = None, version: int = PROTOCOL_VERSION) -> bytes:
    return encode_request(next_rid() if rid is None else rid, mtype, payload, version=version)


def ping(sock: Sock, instance_id: int | None = None, secret: bytes | None = None) -> ReplyFrame:
    """A PING (a probe without an id and secret) that must be answered, for this request."""
    rid = next_rid()
    reply = call(sock, encode_message(rid, Ping(instance_id, secret)))
    assert reply.ok, reply
    assert reply.request_id == rid
    assert isinstance(reply.body["boot_token"], int)
    return reply


def send(sock: Sock, msg: Message) -> ReplyFrame:
    return call(sock, encode_message(next_rid(), msg))


def payload_of(msg: Record, **over: Any) -> list[Any]:
    """``msg``'s payload as it travels, the named fields replaced by raw (wire) values."""
    out = encode_payload(msg)
    names = field_names(type(msg))
    for field, value in over.items():
        out[names.index(field)] = value
    return out


def test_server_info(server: ServerProcess, sock: Sock) -> None:
    reply = call(sock, frame("HELLO", []))
    assert reply.ok
    assert reply.body["protocol_version"] == 5 == PROTOCOL_VERSION
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
    reply = call(sock, frame("PING", [None, None], rid=rid, version=7))
    code, message = error_of(reply)
    assert code == "VERSION_MISMATCH"
    assert "v7" in message and "v5" in message
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
        assert "client speaks v1" in message and "server speaks v5" in message, message
        assert reply.request_id == rid
    assert ping(sock, w.instance_id, secret_of(w)).body["tracked"] is True


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
        ("PING", [], ["PING: expected 2 payload fields", "got 0"]),
        ("PING", [1, SECRET, 3], ["PING: expected 2 payload fields", "got 3"]),
        ("HELLO", [1], ["HELLO: expected 0 payload fields"]),
        ("STORE", [1, SECRET, b""], ["STORE: expected 5 payload fields", "got 3"]),
        ("LOOKUP", [1, SECRET, b"", None, b""], ["LOOKUP: expected 4 payload fields", "got 5"]),
        ("REGISTER_KV_CACHE", [1, SECRET, "m"], ["REGISTER_KV_CACHE: expected 11 payload fields"]),
        ("RETRIEVE", "not a list", ["RETRIEVE: payload must be an array"]),
    ],
)
def test_wrong_arity(sock: Sock, mtype: str, payload: Any, parts: list[str]) -> None:
    expect_error(sock, frame(mtype, payload), "BAD_REQUEST", *parts)


@pytest.mark.parametrize(
    ("mtype", "payload", "parts"),
    [
        ("PING", payload_of(PING1, instance_id="me"), ["PING.instance_id", "expected an integer, got str"]),
        ("PING", payload_of(PING1, instance_id=1.0), ["PING.instance_id", "got float"]),
        ("PING", payload_of(PING1, instance_id=True), ["PING.instance_id", "got bool"]),
        ("LOOKUP", payload_of(LOOKUP1, token_ids=[1, 2, 3]), ["LOOKUP.token_ids", "expected bytes"]),
        ("STORE", payload_of(STORE1, block_ids="blocks"), ["STORE.block_ids", "expected bytes"]),
        (
            "UNREGISTER_KV_CACHE",
            payload_of(UNREG1, instance_id=[1]),
            ["UNREGISTER_KV_CACHE.instance_id", "got list"],
        ),
    ],
)
def test_wrong_types(sock: Sock, mtype: str, payload: Any, parts: list[str]) -> None:
    expect_error(sock, frame(mtype, payload), "BAD_REQUEST", *parts)


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


@pytest.mark.parametrize("iid", [-1, -(1 << 63), 1 << 63, (1 << 64) - 1])
@pytest.mark.parametrize("mtype", ["PING", "LOOKUP", "STORE", "UNREGISTER_KV_CACHE"])
def test_out_of_range_instance_id(sock: Sock, mtype: str, iid: int) -> None:
    valid = {"PING": PING1, "LOOKUP": LOOKUP1, "STORE": STORE1, "UNREGISTER_KV_CACHE": UNREG1}[mtype]
    payload = payload_of(valid, instance_id=iid)
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
        frame("LOOKUP", payload_of(LOOKUP1, token_ids=b"\x00" * n)),
        "BAD_REQUEST",
        "LOOKUP.token_ids",
        f"{n} bytes is not a whole number of int32 ids",
    )
    expect_error(
        sock,
        frame("STORE", payload_of(STORE1, block_ids=b"\x00" * n)),
        "BAD_REQUEST",
        "STORE.block_ids",
        "not a whole number",
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


# ------------------------------------------------------------- against a registered cache


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(ID_DTYPE)


def secret_of(w: WorkerAdapter) -> bytes:
    """The secret the adapter registered with (its REGISTER carries it)."""
    reg = w.registration
    assert isinstance(reg, Register | EngineRegister), reg
    return reg.secret


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
        encode_message(
            next_rid(), Store(w.instance_id, secret_of(w), tokens(2 * 16, seed=bad_index), np.array(blocks))
        ),
        "REQUEST_REFUSED",
        f"block_ids[{bad_index}]",
        f"block {bad_block}",
        "outside the registered cache [0, 64)",
    )
    assert w.lookup(tokens(2 * 16, seed=bad_index)) == 0


def test_store_with_too_few_blocks(sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]) -> None:
    w, _ = worker
    expect_error(
        sock,
        encode_message(next_rid(), Store(w.instance_id, secret_of(w), tokens(2 * CHUNK), np.array([1, 2]))),
        "REQUEST_REFUSED",
        "2 blocks cannot hold 64 tokens",
    )


def test_retrieve_into_blocks_outside_the_cache(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]]
) -> None:
    w, caches = worker
    toks = tokens(CHUNK, seed=99)
    assert w.store(toks, [3, 4])
    before = [c.clone() for c in caches]  # every block: a refused RETRIEVE writes none
    expect_error(
        sock,
        encode_message(next_rid(), Retrieve(w.instance_id, secret_of(w), toks, np.array([7, 64]))),
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
    for msg in (
        Store(424242, SECRET, tokens(CHUNK), np.array([0, 1])),
        Retrieve(424242, SECRET, tokens(CHUNK), np.array([0, 1])),
        Lookup(424242, SECRET, tokens(CHUNK)),
        EngineStore(424242, SECRET, tokens(CHUNK), 0, 1),
        EngineRetrieve(424242, SECRET, tokens(CHUNK), 0, 1),
    ):
        expect_error(
            sock, encode_message(next_rid(), msg), "NOT_REGISTERED", "instance 424242", "not registered"
        )
    reply = send(sock, Unregister(424242, SECRET))
    assert reply.ok and reply.body == {"removed": False}
    assert ping(sock, 424242, SECRET).body["tracked"] is False


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
    reg = dataclasses.replace(registration(w), instance_id=777_000 + len(over), secret=SECRET, **over)
    return encode_payload(reg)


def instance_of(payload: list[Any]) -> int:
    iid = payload[field_names(Register).index("instance_id")]
    assert isinstance(iid, int)
    return iid


def expect_refused_registration(sock: Sock, payload: list[Any], *parts: str) -> str:
    message = expect_error(sock, frame("REGISTER_KV_CACHE", payload), "INVALID_LAYOUT", *parts)
    assert ping(sock, instance_of(payload), SECRET).body["tracked"] is False
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
    assert ping(sock, instance_of(payload), SECRET).body["tracked"] is False


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


# ------------------------------------------------------------------------ secrets on the wire

FRESH = 888_001  # never registered: a message of it that passed the wire checks would be refused


def fresh_message(mtype: str, w: WorkerAdapter) -> Message:
    """A valid message of type ``mtype`` for the unregistered instance FRESH, with SECRET."""
    toks = tokens(2 * CHUNK)
    messages: dict[str, Callable[[], Message]] = {
        "PING": lambda: Ping(FRESH, SECRET),
        "REGISTER_KV_CACHE": lambda: dataclasses.replace(registration(w), instance_id=FRESH, secret=SECRET),
        "UNREGISTER_KV_CACHE": lambda: Unregister(FRESH, SECRET),
        "STORE": lambda: Store(FRESH, SECRET, toks, np.array([0, 1, 2, 3])),
        "RETRIEVE": lambda: Retrieve(FRESH, SECRET, toks, np.array([0, 1, 2, 3])),
        "LOOKUP": lambda: Lookup(FRESH, SECRET, toks),
        "ENGINE_REGISTER": lambda: engine_register_message(FRESH),
        "ENGINE_STORE": lambda: EngineStore(FRESH, SECRET, toks, 0, 2),
        "ENGINE_RETRIEVE": lambda: EngineRetrieve(FRESH, SECRET, toks, 0, 2),
        "ENGINE_RESERVE": lambda: EngineReserve(FRESH, SECRET, toks, 0, 2),
        "ENGINE_COMMIT": lambda: EngineCommit(FRESH, SECRET, 1),
        "ENGINE_ACQUIRE": lambda: EngineAcquire(FRESH, SECRET, toks, 0, 2),
        "ENGINE_RELEASE": lambda: EngineRelease(FRESH, SECRET, 1),
        "BLEND_REGISTER": lambda: BlendRegister(FRESH, SECRET, 8, 10000.0, "neox", 1.0, 4096),
        "BLEND_STORE": lambda: BlendStore(FRESH, SECRET, toks, np.array([0, 1, 2, 3]), 0),
        "BLEND_RETRIEVE": lambda: BlendRetrieve(FRESH, SECRET, toks, np.array([0, 1, 2, 3]), 0),
        "BLEND_RESERVE": lambda: BlendReserve(FRESH, SECRET, toks),
        "BLEND_ACQUIRE": lambda: BlendAcquire(FRESH, SECRET, toks),
    }
    msg = messages[mtype]()
    assert MsgType(mtype) is msg.TYPE
    return msg


INSTANCE_TYPES = [
    "PING",
    "REGISTER_KV_CACHE",
    "UNREGISTER_KV_CACHE",
    "STORE",
    "RETRIEVE",
    "LOOKUP",
    "ENGINE_REGISTER",
    "ENGINE_STORE",
    "ENGINE_RETRIEVE",
    "ENGINE_RESERVE",
    "ENGINE_COMMIT",
    "ENGINE_ACQUIRE",
    "ENGINE_RELEASE",
    "BLEND_REGISTER",
    "BLEND_STORE",
    "BLEND_RETRIEVE",
    "BLEND_RESERVE",
    "BLEND_ACQUIRE",
]


def test_every_instance_message_type_is_covered() -> None:
    assert set(INSTANCE_TYPES) == set(MsgType) - {
        MsgType.HELLO,
        MsgType.GET_SERVER_INFO,
        MsgType.LOOKUP_SCOPE,
    }


def expect_bad_secret(sock: Sock, msg: Message, secret: Any, *parts: str) -> None:
    """The message with ``secret`` in its secret field is refused naming the field, and no
    instance appeared."""
    payload = payload_of(msg, secret=secret)
    expect_error(sock, frame(msg.TYPE, payload), "BAD_REQUEST", f"{msg.TYPE}.secret", *parts)
    assert ping(sock, FRESH, SECRET).body["tracked"] is False


@pytest.mark.parametrize("mtype", INSTANCE_TYPES)
@pytest.mark.parametrize("size", [15, 65])
def test_secret_of_the_wrong_length(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]], mtype: str, size: int
) -> None:
    msg = fresh_message(mtype, worker[0])
    expect_bad_secret(sock, msg, b"s" * size, f"{size} bytes is outside [16, 64]")


@pytest.mark.parametrize("mtype", INSTANCE_TYPES)
@pytest.mark.parametrize("secret", ["s" * 16, 16, [1] * 16], ids=["str", "int", "list"])
def test_secret_that_is_not_bytes(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]], mtype: str, secret: Any
) -> None:
    msg = fresh_message(mtype, worker[0])
    expect_bad_secret(sock, msg, secret, f"expected bytes, got {type(secret).__name__}")


@pytest.mark.parametrize("mtype", [t for t in INSTANCE_TYPES if t != "PING"])
def test_secret_none_is_refused(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]], mtype: str
) -> None:
    expect_bad_secret(sock, fresh_message(mtype, worker[0]), None, "expected bytes, got NoneType")


@pytest.mark.parametrize("mtype", INSTANCE_TYPES)
def test_missing_secret_field(
    sock: Sock, worker: tuple[WorkerAdapter, list[torch.Tensor]], mtype: str
) -> None:
    """A payload without its secret (the v1 layout, sent as v2) is a wrong field count, and the
    message names every field it expects, the secret among them."""
    msg = fresh_message(mtype, worker[0])
    names = field_names(type(msg))
    payload = encode_payload(msg)
    del payload[names.index("secret")]
    expect_error(
        sock,
        frame(mtype, payload),
        "BAD_REQUEST",
        f"{mtype}: expected {len(names)} payload fields ({', '.join(names)}), got {len(names) - 1}",
    )
    assert "secret" in names
    assert ping(sock, FRESH, SECRET).body["tracked"] is False


@pytest.mark.parametrize(
    "payload", [[FRESH, None], [None, SECRET]], ids=["id-without-secret", "secret-without-id"]
)
def test_ping_needs_id_and_secret_together(sock: Sock, payload: list[Any]) -> None:
    expect_error(
        sock, frame("PING", payload), "BAD_REQUEST", "PING.secret", "must be given with an instance_id"
    )
    reply = call(sock, frame("PING", [None, None]))  # the probe: neither
    assert reply.ok and reply.body["tracked"] is None


# ------------------------------------------------------------------------ ownership

Caches = list[torch.Tensor]
_SEEDS = itertools.count(50_000)  # token seeds: every test stores prompts no other test stored


def fresh_tokens() -> np.ndarray:
    return tokens(2 * CHUNK, seed=next(_SEEDS))


def random_caches() -> Caches:
    caches = allocate_kv_caches(**LAYOUT)  # type: ignore[arg-type]
    for c in caches:
        c.copy_(torch.randn(c.shape).to(c.dtype))
    return caches


@pytest.fixture
def victim(server: ServerProcess) -> Iterator[tuple[WorkerAdapter, Caches]]:
    """A fresh server-driven worker, registered with its own (private, random) secret."""
    caches = random_caches()
    w = WorkerAdapter(server.endpoint, model_name="victim", request_timeout=10.0)
    try:
        w.register_kv_caches(caches)
        assert w.registrations == 1
        yield w, caches
    finally:
        w.close()
        free_kv_caches(caches)


@pytest.fixture
def engine_victim(server: ServerProcess) -> Iterator[tuple[WorkerAdapter, Caches]]:
    """A fresh engine-driven worker (ordinary tensors, a 2-slot pool the server owns)."""
    caches = [torch.randn(2, 64, 16, 2, 8).to(torch.bfloat16) for _ in range(4)]  # LAYOUT, unshared
    w = WorkerAdapter(
        server.endpoint,
        model_name="engine-victim",
        transfer_mode="engine_driven",
        pool_chunks=2,
        request_timeout=10.0,
    )
    try:
        w.register_kv_caches(caches)
        assert w.registrations == 1
        yield w, caches
    finally:
        w.close()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> str:
    """The server's HTTP sidecar, once it answers."""
    url = f"http://127.0.0.1:{server.http_port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/instances", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, 30.0, what="the HTTP sidecar")
    return url


def instance_view(http: str, instance_id: int) -> dict[str, Any] | None:
    """The server's HTTP view of one instance (None: not tracked)."""
    r = httpx.get(f"{http}/instances/{instance_id}", timeout=10.0)
    if r.status_code == 404:
        return None
    assert r.status_code == 200, (r.status_code, r.text)
    view: dict[str, Any] = r.json()
    assert view["instance_id"] == instance_id
    return view


def bits(caches: Caches) -> list[torch.Tensor]:
    return [c.view(torch.int16).clone() for c in caches]


def assert_unchanged(caches: Caches, before: list[torch.Tensor]) -> None:
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c.view(torch.int16), b)


def assert_own_round_trip(w: WorkerAdapter, caches: Caches) -> None:
    """The instance still stores its own bytes and retrieves them, byte-equal, elsewhere."""
    toks = fresh_tokens()
    src, dst = [20, 21, 22, 23], [50, 51, 52, 53]
    assert w.lookup(toks) == 0
    assert w.store(toks, src)
    assert w.lookup(toks) == 2 * CHUNK
    assert not all(torch.equal(c[:, src], c[:, dst]) for c in caches)
    assert w.retrieve(toks, dst) == 2 * CHUNK
    for c in caches:
        assert torch.equal(c[:, src].view(torch.int16), c[:, dst].view(torch.int16))


def expect_not_owner(sock: Sock, msg: Message) -> None:
    expect_error(
        sock,
        encode_message(next_rid(), msg),
        "NOT_OWNER",
        f"instance {msg.instance_id} is registered by another owner",  # type: ignore[attr-defined]
    )


def test_register_of_a_live_id_with_another_secret(
    http: str, sock: Sock, victim: tuple[WorkerAdapter, Caches]
) -> None:
    """Neither the victim's own layout nor the attacker's memory can be registered under the
    victim's id without its secret; the victim's context is untouched."""
    w, caches = victim
    attacker_caches = allocate_kv_caches(**LAYOUT)  # type: ignore[arg-type]
    try:
        for c in attacker_caches:
            c.zero_()
        same_layout = dataclasses.replace(registration(w), secret=OTHER)
        own_memory = register_message(w.instance_id, attacker_caches, model="attacker", secret=OTHER)
        for hijack in (same_layout, own_memory):
            assert hijack.secret != secret_of(w)
            expect_not_owner(sock, hijack)
        view = instance_view(http, w.instance_id)
        assert view is not None and view["model_name"] == "victim"
        assert_own_round_trip(w, caches)
        # had the registration moved, the victim's STORE would have read the attacker's memory
        # and its RETRIEVE written there
        for c in attacker_caches:
            assert not c.view(torch.int16).any()
        # the owner's repeat registration is a refresh, as before
        reply = send(sock, registration(w))
        assert reply.ok and reply.body["created"] is False
    finally:
        free_kv_caches(attacker_caches)


def test_engine_register_of_a_live_id_with_another_secret(
    http: str, sock: Sock, engine_victim: tuple[WorkerAdapter, Caches]
) -> None:
    w, caches = engine_victim
    reg = w.registration
    assert isinstance(reg, EngineRegister)
    for hijack in (
        dataclasses.replace(reg, secret=OTHER),
        dataclasses.replace(reg, secret=OTHER, model_name="attacker", pool_chunks=4),
    ):
        expect_not_owner(sock, hijack)  # and no pool segment is handed out
    view = instance_view(http, w.instance_id)
    assert view is not None and view["model_name"] == "engine-victim"
    assert view["transfer_mode"] == "engine_driven"
    assert_own_round_trip(w, caches)
    reply = send(sock, reg)  # the owner's repeat registration: a refresh, its pool kept
    assert reply.ok and reply.body["created"] is False and reply.body["slots"] == 2


@pytest.mark.parametrize("mtype", ["STORE", "RETRIEVE", "LOOKUP", "UNREGISTER_KV_CACHE"])
def test_wrong_secret_is_not_owner_and_changes_nothing(
    http: str, sock: Sock, victim: tuple[WorkerAdapter, Caches], mtype: str
) -> None:
    w, caches = victim
    iid = w.instance_id
    stored, other = fresh_tokens(), fresh_tokens()
    assert w.store(stored, [0, 1, 2, 3])
    assert w.lookup(other) == 0
    make: dict[str, Callable[[bytes], Message]] = {
        "STORE": lambda s: Store(iid, s, other, np.array([4, 5, 6, 7])),
        "RETRIEVE": lambda s: Retrieve(iid, s, stored, np.array([8, 9, 10, 11])),
        "LOOKUP": lambda s: Lookup(iid, s, stored),
        "UNREGISTER_KV_CACHE": lambda s: Unregister(iid, s),
    }
    msg = make[mtype](OTHER)
    before = bits(caches)

    expect_not_owner(sock, msg)

    assert_unchanged(caches, before)  # a RETRIEVE wrote no block
    assert w.lookup(other) == 0  # a STORE stored nothing
    assert w.lookup(stored) == 2 * CHUNK  # what was stored is still there
    assert ping(sock, iid, secret_of(w)).body["tracked"] is True  # an UNREGISTER released nothing
    assert instance_view(http, iid) is not None
    assert_own_round_trip(w, caches)
    # the same request with the owner's secret is served (the check above could fail)
    reply = send(sock, make[mtype](secret_of(w)))
    assert reply.ok, reply
    expected = {
        "STORE": {"chunks": 2, "stored": 2, "present": 0, "rejected": 0, "skipped": 0},
        "RETRIEVE": {"retrieved_tokens": 2 * CHUNK},
        "LOOKUP": {"hit_tokens": 2 * CHUNK},
        "UNREGISTER_KV_CACHE": {"removed": True},
    }[mtype]
    assert reply.body == expected


@pytest.mark.parametrize("mtype", ["ENGINE_STORE", "ENGINE_RETRIEVE", "LOOKUP", "UNREGISTER_KV_CACHE"])
def test_engine_wrong_secret_is_not_owner_and_changes_nothing(
    http: str, sock: Sock, engine_victim: tuple[WorkerAdapter, Caches], mtype: str
) -> None:
    w, caches = engine_victim
    iid = w.instance_id
    stored, other = fresh_tokens(), fresh_tokens()
    assert w.store(stored, [0, 1, 2, 3])
    assert w.lookup(other) == 0
    make: dict[str, Callable[[bytes], Message]] = {
        "ENGINE_STORE": lambda s: EngineStore(iid, s, other, 0, 2),
        "ENGINE_RETRIEVE": lambda s: EngineRetrieve(iid, s, stored, 0, 2),
        "LOOKUP": lambda s: Lookup(iid, s, stored),
        "UNREGISTER_KV_CACHE": lambda s: Unregister(iid, s),
    }
    msg = make[mtype](OTHER)
    before = bits(caches)

    expect_not_owner(sock, msg)

    assert_unchanged(caches, before)
    assert w.lookup(other) == 0
    assert w.lookup(stored) == 2 * CHUNK
    assert ping(sock, iid, secret_of(w)).body["tracked"] is True
    view = instance_view(http, iid)
    assert view is not None and view["transfer_mode"] == "engine_driven"
    assert_own_round_trip(w, caches)
    reply = send(sock, make[mtype](secret_of(w)))
    assert reply.ok, reply
    expected = {
        "ENGINE_STORE": {"chunks": 2, "stored": 2, "present": 0, "rejected": 0, "skipped": 0},
        "ENGINE_RETRIEVE": {"chunks": 2},
        "LOOKUP": {"hit_tokens": 2 * CHUNK},
        "UNREGISTER_KV_CACHE": {"removed": True},
    }[mtype]
    assert reply.body == expected


def test_engine_transfers_with_a_wrong_secret_leave_the_pool_alone(sock: Sock) -> None:
    """Raw engine-driven registration, its pool mapped here: an ENGINE_RETRIEVE with a wrong
    secret writes no byte of the pool, an ENGINE_STORE with one stores none of it."""
    iid = 888_100
    reply = send(sock, engine_register_message(iid, pool_chunks=2))
    assert reply.ok and reply.body["created"] is True, reply
    body = reply.body
    pool = Segment.attach(body["segment"], body["slot_bytes"] * body["slots"])
    flat = pool.as_tensor()[: body["slot_bytes"] * body["slots"]]
    try:
        stored, other = fresh_tokens(), fresh_tokens()
        pattern = torch.randint(0, 256, flat.shape, dtype=torch.uint8)
        flat.copy_(pattern)
        r = send(sock, EngineStore(iid, SECRET, stored, 0, 2))
        assert r.ok and r.body["stored"] == 2, r
        flat.zero_()

        expect_not_owner(sock, EngineRetrieve(iid, OTHER, stored, 0, 2))
        assert not flat.any()  # no slot was filled
        flat.copy_(pattern)
        expect_not_owner(sock, EngineStore(iid, OTHER, other, 0, 2))
        r = send(sock, Lookup(iid, SECRET, other))
        assert r.ok and r.body == {"hit_tokens": 0}  # nothing of the pool was stored

        flat.zero_()
        r = send(sock, EngineRetrieve(iid, SECRET, stored, 0, 2))  # the owner's is served
        assert r.ok and r.body == {"chunks": 2}, r
        assert torch.equal(flat, pattern)
    finally:
        del flat
        r = send(sock, Unregister(iid, SECRET))
        assert r.ok and r.body == {"removed": True}
        pool.close()


@pytest.mark.parametrize("mode", ["server_driven", "engine_driven"])
def test_ping_with_a_wrong_secret_is_untracked_and_touches_nothing(http: str, sock: Sock, mode: str) -> None:
    """A PING with the right id but a wrong secret answers ``tracked: false`` and neither
    refreshes ``last_seen`` nor latches the liveness signal (the HTTP view shows both)."""
    iid = 888_200 if mode == "server_driven" else 888_201
    caches = allocate_kv_caches(**LAYOUT) if mode == "server_driven" else []  # type: ignore[arg-type]
    try:
        reg = register_message(iid, caches) if caches else engine_register_message(iid)
        reply = send(sock, reg)
        assert reply.ok and reply.body["created"] is True, reply
        view = wait_until(lambda: instance_view(http, iid), 10.0, what="the HTTP view of the instance")
        assert view["has_liveness_signal"] is False and view["transfer_mode"] == mode
        silent = wait_until(
            lambda: (v := instance_view(http, iid)) is not None and v["last_seen_seconds_ago"] >= 1.0 and v,
            10.0,
            what="a second of silence",
        )

        for secret in (OTHER, SECRET[::-1], SECRET + b"\x00", SECRET[:-1] + b"\x00" * 2):
            assert secret != SECRET
            assert ping(sock, iid, secret).body["tracked"] is False

        after = instance_view(http, iid)
        assert after is not None
        assert after["has_liveness_signal"] is False
        assert after["last_seen_seconds_ago"] >= silent["last_seen_seconds_ago"]  # not refreshed
        # the owner's PING, for contrast, is tracked, latches and refreshes
        assert ping(sock, iid, SECRET).body["tracked"] is True
        touched = instance_view(http, iid)
        assert touched is not None and touched["has_liveness_signal"] is True
        assert touched["last_seen_seconds_ago"] < silent["last_seen_seconds_ago"]
    finally:
        r = send(sock, Unregister(iid, SECRET))
        assert r.ok and r.body == {"removed": True}, r
        if caches:
            free_kv_caches(caches)
