"""Scoped chunks and `RemoteBackend.clear_scope` against real redis-server processes: a scope's
chunks have names of their own, a clear removes exactly them (whatever the prefix holds of glob
characters), drops the scope's queued writes and waits for the one on the wire, and answers
None when Redis is gone."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator

import pytest

from dataplane.events.sink import EventSink
from dataplane.events.vllm_format import MEDIUM_EXTERNAL
from dataplane.storage.keys import ScopeMatch
from dataplane.storage.lower import WriteSpace
from dataplane.storage.remote import RemoteBackend
from tests.helpers import wait_until
from tests.redis_server import RedisServer

SHAPE = (4, 16, 64)  # bfloat16: 8 KiB
NBYTES = 4 * 16 * 64 * 2
TIMEOUT_S = 2.0
A, B = b"scope-a-scope-a-", b"\x00scope-b\x00scope-b"  # (16 bytes, as scopes are)


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _backend(url: str, prefix: str = "kvwarden:") -> RemoteBackend:
    b = RemoteBackend(url, timeout_s=TIMEOUT_S, prefix=prefix, queue_bytes=64 * NBYTES)
    b.start()
    return b


def _close(b: RemoteBackend) -> None:
    b.stop()
    b.join(10)
    b.close()


@pytest.fixture
def backend(redis_server: RedisServer) -> Iterator[RemoteBackend]:
    b = _backend(redis_server.url)
    try:
        yield b
    finally:
        _close(b)


def _put(b: RemoteBackend, key: bytes, scope: bytes = b"") -> bytes:
    data = os.urandom(NBYTES)
    assert b.put(key, "bfloat16", SHAPE, memoryview(data), scope=scope)
    return data


def _names(r: RedisServer) -> set[str]:
    raw = r.client()
    try:
        return {n.decode() for n in raw.keys("*")}
    finally:
        raw.close()


def _removed(sink: EventSink) -> list[bytes]:
    """The keys reported removed since the last look (each from the remote tier)."""
    removed = [e for e in sink.take(1 << 20) if e[0] == "removed"]
    assert all(e[2] == MEDIUM_EXTERNAL for e in removed), removed
    return [e[1] for e in removed]


class _HoldSpace(WriteSpace):
    """The backend's `WriteSpace`; once `hold` is set, the next write that asks whether there is
    room (the writer, before it sends anything) waits there until `release` is set."""

    def __init__(self) -> None:
        super().__init__("remote tier (test)")
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.release = threading.Event()

    @property
    def out(self) -> bool:
        if self.hold.is_set():
            self.hold.clear()
            self.holding.set()
            assert self.release.wait(30)
        return super().out


class _Gate:
    """The backend's write gate, noting the name of every thread that comes to take it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.came: list[str] = []

    def __enter__(self) -> None:
        self.came.append(threading.current_thread().name)
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


class _Order:
    """The ``done`` calls of writes, by label, in the order they came."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list[str] = []

    def __call__(self, label: str) -> None:
        with self.lock:
            self.done.append(label)


def test_a_clear_removes_exactly_its_scope(backend: RemoteBackend, redis_server: RedisServer) -> None:
    sink = EventSink()
    backend.events = sink
    a = {_key(i): _put(backend, _key(i), A) for i in range(3)}
    b = {_key(i): _put(backend, _key(i), B) for i in (1, 7)}  # (one key in both scopes)
    plain = _put(backend, _key(1))
    assert backend.flush(10)
    plain_name, b_names = f"kvwarden:{_key(1).hex()}", {f"kvwarden:{B.hex()}:{k.hex()}" for k in b}
    assert _names(redis_server) == {f"kvwarden:{A.hex()}:{k.hex()}" for k in a} | b_names | {plain_name}
    sink.take(1 << 20)  # (the chunks stored)

    assert backend.clear_scope(ScopeMatch(A)) == 3
    assert sorted(_removed(sink)) == sorted(a)
    assert all(backend.get(k, "bfloat16", SHAPE, scope=A) is None for k in a)
    for k, data in b.items():
        got = backend.get(k, "bfloat16", SHAPE, scope=B)
        assert got is not None and bytes(got) == data
    got = backend.get(_key(1), "bfloat16", SHAPE)
    assert got is not None and bytes(got) == plain
    assert _names(redis_server) == b_names | {plain_name}
    assert backend.clear_scope(ScopeMatch(A)) == 0 and backend.stats().cleared == 3
    with pytest.raises(ValueError):
        backend.clear_scope(ScopeMatch(b""))


def test_a_clear_removes_names_past_a_batch(backend: RemoteBackend, redis_server: RedisServer) -> None:
    sink = EventSink()
    backend.events = sink
    raw = redis_server.client()
    pipe = raw.pipeline(transaction=False)
    for i in range(2500):  # past SCAN's COUNT and an UNLINK batch (1000)
        pipe.set(backend.redis_key(_key(i), A), b"x")
    pipe.set(f"kvwarden:{A.hex()}:not-a-key", b"x")  # under the scope's names, but no chunk's
    pipe.set(backend.redis_key(_key(1), B), b"x")
    pipe.execute()
    assert backend.clear_scope(ScopeMatch(A)) == 2501
    assert sorted(_removed(sink)) == [_key(i) for i in range(2500)]  # (no key for the odd name)
    assert raw.dbsize() == 1 and raw.exists(backend.redis_key(_key(1), B))
    raw.close()


def test_glob_characters_in_the_prefix_match_only_themselves(redis_server: RedisServer) -> None:
    # unescaped, this prefix's pattern (kv*[x]?\:<scope>:*) would match the other's names too
    globby, other = _backend(redis_server.url, "kv*[x]?\\:"), _backend(redis_server.url, "kvAAxy:")
    try:
        for b in (globby, other):
            for i in range(3):
                _put(b, _key(i), A)
            assert b.flush(10)
        assert globby.clear_scope(ScopeMatch(A)) == 3
        assert _names(redis_server) == {other.redis_key(_key(i), A) for i in range(3)}
        assert other.count_prefix([_key(i) for i in range(3)], scope=A) == 3
        assert other.clear_scope(ScopeMatch(A)) == 3 and _names(redis_server) == set()
    finally:
        _close(globby)
        _close(other)


def test_queued_writes_of_the_scope_are_dropped_and_the_one_on_the_wire_waited_for(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    space, gate, order, sink = _HoldSpace(), _Gate(), _Order(), EventSink()
    backend.space, backend._write_gate, backend.events = space, gate, sink  # (the writer is idle)
    space.hold.set()
    _put(backend, _key(0), A)  # taken by the writer, which then holds (the gate held, unsent)
    wait_until(space.holding.is_set, 10, what="the writer to hold")
    for label, key, scope in (("a1", 1, A), ("b1", 1, B), ("a2", 2, A), ("b2", 2, B)):
        data = memoryview(os.urandom(NBYTES))
        assert backend.put(_key(key), "bfloat16", SHAPE, data, lambda label=label: order(label), scope=scope)
    assert backend.stats().queue_depth == 4

    cleared: list[int | None] = []
    clear = threading.Thread(target=lambda: cleared.append(backend.clear_scope(ScopeMatch(A))), name="clear")
    clear.start()
    try:
        # A's queued writes are dropped (released) at once, then the clear waits for the writer
        wait_until(lambda: "clear" in gate.came, 10, what="the clear to wait for the write on the wire")
        assert order.done == ["a1", "a2"] and backend.stats().drops["cleared"] == 2
        assert backend.stats().queue_depth == 2 and clear.is_alive() and not cleared
    finally:
        space.release.set()
    clear.join(10)
    assert cleared == [1]  # the write that was on the wire landed, then the clear removed it
    assert backend.flush(10) and order.done == ["a1", "a2", "b1", "b2"]  # B's, in their order
    assert _names(redis_server) == {backend.redis_key(_key(i), B) for i in (1, 2)}
    assert backend.get(_key(0), "bfloat16", SHAPE, scope=A) is None
    assert _removed(sink) == [_key(0)]
    s = backend.stats()
    assert s.puts == 3 and s.cleared == 1 and s.drops["cleared"] == 2


def test_a_clear_answers_none_when_redis_is_gone_or_bypassed(
    backend: RemoteBackend, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    _put(backend, _key(1), A)
    assert backend.flush(10)
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="dataplane.storage.remote.backend"):
        assert backend.clear_scope(ScopeMatch(A)) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "connection" in warnings[0], warnings
    assert backend.stats().cleared == 0

    redis_server.start()  # empty (no persistence): the chunk went with the process
    backend.bypassed = True
    assert backend.clear_scope(ScopeMatch(A)) is None
    backend.bypassed = False
    assert backend.clear_scope(ScopeMatch(A)) == 0


@pytest.fixture(params=["direct", "redis-py"])
def reader(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[RemoteBackend]:
    """A backend that reads through the direct reader, or through redis-py."""
    b = _backend(redis_server.url)
    if request.param == "redis-py":
        assert b._direct is not None
        b._direct.close()
        b._direct = None
    try:
        yield b
    finally:
        _close(b)


def test_scoped_reads_find_the_scoped_name_only(reader: RemoteBackend) -> None:
    plain1 = _put(reader, _key(1))  # unscoped only
    scoped2 = _put(reader, _key(2), A)  # scope A only
    plain3, scoped3 = _put(reader, _key(3)), _put(reader, _key(3), A)  # both, different bytes
    assert reader.flush(10)

    assert reader.count_prefix([_key(2), _key(3)], scope=A) == 2
    assert reader.count_prefix([_key(1)], scope=A) == 0 and reader.count_prefix([_key(1)]) == 1
    assert reader.count_prefix([_key(2)]) == 0 and reader.count_prefix([_key(3)], scope=B) == 0

    def get(key: bytes, scope: bytes = b"") -> bytes | None:
        got = reader.get(key, "bfloat16", SHAPE, scope=scope)
        return None if got is None else bytes(got)

    assert get(_key(1)) == plain1 and get(_key(1), A) is None
    assert get(_key(2), A) == scoped2 and get(_key(2)) is None
    assert get(_key(3), A) == scoped3 and get(_key(3)) == plain3

    answers: dict[tuple[int, bytes], bytes | None] = {}
    done = threading.Event()
    asked = [(1, A), (2, A), (3, A), (3, b""), (2, b"")]

    def then(i: int, scope: bytes) -> Callable[[memoryview | None], None]:
        def answer(mv: memoryview | None) -> None:
            answers[(i, scope)] = None if mv is None else bytes(mv)
            if len(answers) == len(asked):
                done.set()

        return answer

    for i, scope in asked:
        assert reader.get_later(_key(i), "bfloat16", SHAPE, then(i, scope), scope=scope)
    assert done.wait(10)
    assert answers == {(1, A): None, (2, A): scoped2, (3, A): scoped3, (3, b""): plain3, (2, b""): None}
