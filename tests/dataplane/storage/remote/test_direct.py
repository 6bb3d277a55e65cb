"""The remote tier's direct reads (`dataplane.storage.remote.direct`) against real redis-server
processes: the payload lands in the buffer given for it, connections are reused and never left
mid-value, credentials, databases and Unix sockets are honoured, and every failure is one
counted miss after which reads go on."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from dataplane.storage.codec import RemoteValueError, encode
from dataplane.storage.remote import RemoteBackend, direct
from dataplane.storage.remote.direct import DirectGets, _Conn, _Value
from tests.redis_server import RedisServer

SHAPE = (4, 16, 64)  # bfloat16: 8 KiB
NBYTES = 4 * 16 * 64 * 2
TIMEOUT_S = 2.0


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


class _Buffers:
    """``alloc`` / ``give_back`` over numpy arrays, remembering what was handed out and back."""

    def __init__(self, room: bool = True) -> None:
        self.room = room
        self.given: list[np.ndarray] = []
        self.back: list[memoryview] = []

    def alloc(self, n: int) -> memoryview | None:
        if not self.room:
            return None
        a = np.zeros(n, np.uint8)
        self.given.append(a)
        return memoryview(a).cast("B")

    def give_back(self, mv: memoryview) -> None:
        self.back.append(mv)


def _stored(b: RemoteBackend, key: bytes) -> bytes:
    data = os.urandom(NBYTES)
    assert b.put(key, "bfloat16", SHAPE, memoryview(data))
    assert b.flush(10)
    return data


@pytest.fixture
def backend(redis_server: RedisServer) -> Iterator[RemoteBackend]:
    b = RemoteBackend(redis_server.url, timeout_s=TIMEOUT_S)
    b.start()
    try:
        yield b
    finally:
        b.stop()
        b.join(10)
        b.close()


def _kvwarden_clients(r: RedisServer) -> int:
    raw = r.client()
    try:
        return sum(1 for c in raw.client_list() if c.get("name") == "kvwarden")
    finally:
        raw.close()


def test_the_payload_lands_in_the_buffer_given_and_connections_are_reused(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    data = {i: _stored(backend, _key(i)) for i in range(3)}
    bufs = _Buffers()
    for _ in range(2):
        for i, want in data.items():
            got = backend.get(_key(i), "bfloat16", SHAPE, bufs.alloc, bufs.give_back)
            assert got is not None and bytes(got) == want
            assert np.shares_memory(np.frombuffer(got, np.uint8), bufs.given[-1])  # no copy after
    before = _kvwarden_clients(redis_server)
    for i in data:
        assert backend.get(_key(i), "bfloat16", SHAPE) is not None
    assert _kvwarden_clients(redis_server) == before  # the reads' connection was kept
    assert backend.get(_key(9), "bfloat16", SHAPE, bufs.alloc) is None  # a plain miss: nothing given
    s = backend.stats()
    assert (s.hits, s.misses, len(bufs.given), bufs.back) == (9, 1, 6, [])


def test_no_room_and_bad_values_give_their_buffer_back_and_leave_no_connection_mid_value(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    good = _stored(backend, _key(1))
    flipped = bytearray(encode(_key(2), "bfloat16", SHAPE, os.urandom(NBYTES)))
    flipped[-10] ^= 1
    raw = redis_server.client()
    raw.set(backend.redis_key(_key(2)), bytes(flipped))
    raw.rpush(backend.redis_key(_key(3)), b"a list, not a string")
    raw.close()
    full = _Buffers(room=False)
    assert backend.get(_key(1), "bfloat16", SHAPE, full.alloc) is None  # left mid-value: closed
    bufs = _Buffers()
    assert backend.get(_key(2), "bfloat16", SHAPE, bufs.alloc, bufs.give_back) is None
    assert len(bufs.back) == 1 and bufs.back[0].obj is bufs.given[0]  # the damaged value's buffer
    assert backend.get(_key(3), "bfloat16", SHAPE, bufs.alloc, bufs.give_back) is None  # WRONGTYPE
    assert backend.get(_key(1), "bfloat16", (8, 16, 32), bufs.alloc, bufs.give_back) is None  # layout
    assert len(bufs.given) == 1  # a value of another layout never gets a caller's buffer
    got = backend.get(_key(1), "bfloat16", SHAPE, bufs.alloc, bufs.give_back)
    assert got is not None and bytes(got) == good  # reads go on, on a sound connection
    s = backend.stats()
    assert s.bad_values == {"checksum": 1, "layout": 1} and s.get_failures["error"] == 1


def test_a_connection_redis_kills_is_one_counted_failure_at_most_then_reads_go_on(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    want = _stored(backend, _key(1))
    assert backend.get(_key(1), "bfloat16", SHAPE) is not None  # a connection is idle now
    raw = redis_server.client()
    assert raw.client_kill_filter(_type="normal", skipme=True) >= 1
    raw.close()
    backend.get(_key(1), "bfloat16", SHAPE)  # may fail on the killed connection
    got = backend.get(_key(1), "bfloat16", SHAPE)
    assert got is not None and bytes(got) == want
    assert sum(backend.stats().get_failures.values()) <= 1


def test_credentials_a_database_and_a_unix_socket_are_honoured(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    r = RedisServer(extra=["--requirepass", "pw-1", "--unixsocket", str(sock), "--unixsocketperm", "700"])
    try:
        for url in (f"redis://:pw-1@127.0.0.1:{r.port}/3", f"unix://:pw-1@{sock}?db=3"):
            b = RemoteBackend(url, timeout_s=TIMEOUT_S)
            b.start()
            try:
                assert b._direct is not None
                want = _stored(b, _key(7))
                got = b.get(_key(7), "bfloat16", SHAPE)
                assert got is not None and bytes(got) == want
            finally:
                b.stop()
                b.join(10)
                b.close()
        raw = redis.Redis(host="127.0.0.1", port=r.port, password="pw-1", db=3, socket_timeout=10)
        assert raw.dbsize() == 1  # both URLs wrote and read database 3
        raw.close()
        wrong = RemoteBackend(f"unix://:nope@{sock}?db=3", timeout_s=TIMEOUT_S)
        assert wrong.get(_key(7), "bfloat16", SHAPE) is None
        assert wrong.stats().get_failures["auth"] == 1
        wrong.close()
    finally:
        r.stop()


def test_clusters_and_tls_are_read_through_redis_py() -> None:
    assert DirectGets.for_url("redis://127.0.0.1:6379/0", None, 1.0) is not None
    assert DirectGets.for_url("unix:///tmp/r.sock", None, 1.0) is not None
    assert DirectGets.for_url("rediss://127.0.0.1:6380/0", None, 1.0) is None
    assert DirectGets.for_url("redis+cluster://127.0.0.1:7000", None, 1.0) is None


def _getrange_calls(r: RedisServer) -> int:
    raw = r.client()
    try:
        return int(raw.info("commandstats").get("cmdstat_getrange", {}).get("calls", 0))
    finally:
        raw.close()


def test_a_value_is_read_in_ranges_that_cover_it_exactly(
    backend: RemoteBackend, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranges of 3000 bytes: the 8 KiB chunk and its header in three, the last one short; a
    value larger than its layout asked for (another shape's) is read to its end in more ranges
    and refused as another layout; a missing one is a plain miss, its connection kept."""
    monkeypatch.setattr(direct, "RANGE", 3000)
    want = _stored(backend, _key(1))
    bufs = _Buffers()
    before = _getrange_calls(redis_server)
    got = backend.get(_key(1), "bfloat16", SHAPE, bufs.alloc, bufs.give_back)
    assert got is not None and bytes(got) == want
    assert _getrange_calls(redis_server) - before == 3  # (8192 + 36 bytes)
    assert backend.get(_key(1), "bfloat16", (2, 16, 64), bufs.alloc, bufs.give_back) is None
    assert backend.stats().bad_values == {"layout": 1}
    clients = _kvwarden_clients(redis_server)
    assert backend.get(_key(2), "bfloat16", SHAPE, bufs.alloc) is None  # (nothing there)
    got = backend.get(_key(1), "bfloat16", SHAPE, bufs.alloc, bufs.give_back)
    assert got is not None and bytes(got) == want
    assert _kvwarden_clients(redis_server) == clients and len(bufs.given) == 2


@pytest.fixture
def replies() -> Iterator[Callable[..., _Conn]]:
    """Connections whose peer has sent the replies given (as Redis frames them), then no more."""
    socks: list[socket.socket] = []

    def conn(*parts: bytes) -> _Conn:
        a, b = socket.socketpair()
        socks.extend((a, b))
        b.sendall(b"".join(parts))
        b.shutdown(socket.SHUT_WR)  # (b stays open: the reader's commands go to it)
        return _Conn(a)

    try:
        yield conn
    finally:
        for s in socks:
            s.close()


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def test_ranges_of_another_length_than_the_value_had_are_a_truncated_value(
    monkeypatch: pytest.MonkeyPatch, replies: Callable[..., _Conn]
) -> None:
    """A value that changed or went between its STRLEN and its ranges (another server's write,
    a clear): its ranges no longer add up, and the read is refused, never stitched."""
    monkeypatch.setattr(direct, "RANGE", 6)
    gone = b"$0\r\n\r\n"
    value = _Value.ask(replies(b":10\r\n", _bulk(b"abcdef"), _bulk(b"ab")), b"k", 12)  # (it shrank)
    assert value is not None and value.total == 10
    with pytest.raises(RemoteValueError, match="a range of 2 bytes, not 4") as exc:
        value.read_into(memoryview(bytearray(10)))
    assert exc.value.kind == "truncated"
    value = _Value.ask(replies(b":6\r\n", _bulk(b"abcdef"), _bulk(b"gh")), b"k", 8)  # (it grew)
    assert value is not None
    value.read_into(memoryview(bytearray(6)))
    with pytest.raises(RemoteValueError, match="a range of 2 bytes, not 0"):
        value.end()
    assert _Value.ask(replies(b":0\r\n", gone, gone), b"k", 8) is None  # a miss
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        _Value.ask(replies(b"-WRONGTYPE Operation against a key\r\n"), b"k", 8)
