"""Bad payload fields against a real server process: arity, types and ranges at the wire
edge, block ids and instances a registered cache refuses, and registrations of a layout the
server cannot map. Every one gets an error reply naming the field, and the server keeps answering."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter
from dataplane.wire.errors import NotRegistered, RequestError
from dataplane.wire.messages import (
    CudaLayer,
    EngineRetrieve,
    EngineStore,
    Lookup,
    MemoryKind,
    Register,
    Retrieve,
    ShmLayer,
    Store,
    Unregister,
    encode_payload,
    field_names,
)
from dataplane.wire.protocol import encode_message
from tests.dataplane.registration import SECRET
from tests.dataplane.server.wire_client import (
    CHUNK,
    LOOKUP1,
    PING1,
    STORE1,
    UNREG1,
    Sock,
    expect_error,
    frame,
    payload_of,
    ping,
    registration,
    secret_of,
    send,
    tokens,
)
from tests.helpers import call, error_of, next_rid

# ------------------------------------------------------------------ fields at the wire edge


@pytest.mark.parametrize(
    ("mtype", "payload", "parts"),
    [
        ("PING", [], ["PING: expected 2 payload fields", "got 0"]),
        ("PING", [1, SECRET, 3], ["PING: expected 2 payload fields", "got 3"]),
        ("HELLO", [1], ["HELLO: expected 0 payload fields"]),
        ("STORE", [1, SECRET, b""], ["STORE: expected 6 payload fields", "got 3"]),
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


# ------------------------------------------------------------- against a registered cache


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
    assert code == "INVALID_LAYOUT" and "CUDA" in message, (code, message)
    if torch.cuda.is_available():  # a handle CUDA refuses: named, and no traceback in the log
        assert "layer 0: cannot open its CUDA IPC handle" in message, message
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
