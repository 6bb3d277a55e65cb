"""Secrets and ownership at the wire edge of a real server process: every message about an
instance is refused for a malformed or missing secret, and one with another owner's secret is
``NOT_OWNER`` and changes nothing."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from dataplane.memory.shm import Segment
from dataplane.wire.messages import (
    BlendAcquire,
    BlendRegister,
    BlendReserve,
    BlendRetrieve,
    BlendStore,
    EngineAcquire,
    EngineCommit,
    EngineRegister,
    EngineRelease,
    EngineReserve,
    EngineRetrieve,
    EngineStore,
    Lookup,
    Message,
    MsgType,
    Ping,
    Retrieve,
    Store,
    Unregister,
    encode_payload,
    field_names,
)
from dataplane.wire.protocol import encode_message
from tests.dataplane.registration import SECRET, engine_register_message, register_message
from tests.dataplane.server.wire_client import (
    CHUNK,
    LAYOUT,
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
from tests.helpers import ServerProcess, call, next_rid, wait_until

OTHER = bytes(range(100, 116))  # an attacker's secret: anything but the victim's


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
        MsgType.LOOKUP_WAITED,
        MsgType.PREFETCH_SCOPE,
        MsgType.CLEAR_SCOPE,
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
        "LOOKUP": {"hit_tokens": 2 * CHUNK, "pending_tokens": 0},
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
        "LOOKUP": {"hit_tokens": 2 * CHUNK, "pending_tokens": 0},
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
        assert r.ok and r.body == {"hit_tokens": 0, "pending_tokens": 0}  # nothing of the pool was stored

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
