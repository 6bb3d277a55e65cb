"""TieredStore: without a remote tier, the health gate and its rate-limited warnings; staging
only (hot cache off) drops what no reader holds. With a real redis-server (started here, paused
with SIGSTOP): what the loop thread may call (`acquire_local`) never waits on it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from dataplane.storage import tiered
from dataplane.storage.remote import RemoteBackend
from dataplane.storage.tiered import TieredStore
from tests.redis_server import RedisServer


def _store(t: TieredStore, key: bytes) -> None:
    buf = t.reserve(4096)
    assert buf is not None
    assert t.commit(key, buf)


def test_the_gate_closes_reads_writes_and_lookups(caplog: pytest.LogCaptureFixture) -> None:
    healthy = [True]
    t = TieredStore(1 << 20, gate=lambda: healthy[0])
    _store(t, b"k" * 16)
    assert t.writable() and t.prefix_hits([b"k" * 16]) == 1
    healthy[0] = False
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            assert not t.writable()
            assert t.prefix_hits([b"k" * 16]) == 0
            assert t.acquire_prefix([b"k" * 16]) == []
    lines = [r.message for r in caplog.records if "unhealthy (recompute)" in r.message]
    assert sorted(line.split(": ")[2].split(" ")[0] for line in lines) == ["LOOKUP", "RETRIEVE", "STORE"]
    healthy[0] = True
    bufs = t.acquire_prefix([b"k" * 16])
    assert len(bufs) == 1  # L1 kept it: open again, it is served
    t.release([b"k" * 16])


def test_warnings_resume_with_the_count_of_what_was_skipped(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    t = TieredStore(1 << 20, clock=lambda: now[0], gate=lambda: False)
    with caplog.at_level(logging.WARNING):
        for _ in range(7):
            t.writable()
        now[0] += tiered.WARN_EVERY_S
        t.writable()
    lines = [r.message for r in caplog.records if "STORE skipped" in r.message]
    assert len(lines) == 2 and "(6 more since the last warning)" in lines[1]


def test_discard_keeps_what_a_reader_holds() -> None:
    t = TieredStore(1 << 20)
    _store(t, b"a" * 16)
    _store(t, b"b" * 16)
    held = t.acquire_prefix([b"a" * 16])
    assert len(held) == 1
    assert t.discard([b"a" * 16, b"b" * 16, b"c" * 16]) == 1  # b only: a is read, c absent
    assert t.prefix_hits([b"a" * 16, b"b" * 16]) == 1
    t.release([b"a" * 16])
    assert t.discard([b"a" * 16]) == 1 and t.stats().chunks == 0


@pytest.fixture
def backend(redis_server: RedisServer) -> Iterator[RemoteBackend]:
    b = RemoteBackend(redis_server.url, timeout_s=2.0)
    b.start()
    try:
        yield b
    finally:
        b.stop()
        b.join(10)
        b.close()


def test_acquire_local_never_asks_the_remote_tier(redis_server: RedisServer, backend: RemoteBackend) -> None:
    """L1 holds chunk a; Redis holds a and b. Redis stopped (SIGSTOP): `acquire_local` of a is
    L1's answer, and of a, b is None at once, leaving nothing pinned; `acquire_prefix` (what the
    transfer pool calls) reads b from Redis once it answers again."""
    ka, kb = b"a" * 16, b"b" * 16
    writer = TieredStore(1 << 20, remote=backend)  # another server's L1, sharing the Redis
    for k in (ka, kb):
        _store(writer, k)
    assert backend.flush(10)
    t = TieredStore(1 << 20, remote=backend)
    buf = t.reserve(4096)
    assert buf is not None and t.commit(ka, buf) and backend.flush(10)
    before = backend.stats()
    redis_server.pause()
    try:
        got = t.acquire_local([ka])
        assert got is not None and len(got) == 1
        t.release([ka])
        assert t.acquire_local([ka, kb]) is None
        # Redis was never asked (so nothing waited on it): no GET, no call of any kind timed
        after = backend.stats()
        assert (after.gets, after.durations) == (before.gets, before.durations)
    finally:
        redis_server.resume()
    assert t.discard([ka]) == 1  # nothing was left pinned
    bufs = t.acquire_prefix([ka, kb])  # from Redis, promoted into L1
    assert len(bufs) == 2 and t.promoted == 2
    t.release([ka, kb])
    assert TieredStore(1 << 20, gate=lambda: False, remote=backend).acquire_local([ka]) == []
    plain = TieredStore(1 << 20)  # no remote tier: L1's answer, short or not
    _store(plain, ka)
    got = plain.acquire_local([ka, kb])
    assert got is not None and len(got) == 1
    plain.release([ka])


def _filled(t: TieredStore, key: bytes, value: int) -> None:
    buf = t.reserve(4096)
    assert buf is not None
    buf.fill_(value)
    assert t.commit(key, buf)


def test_a_lookup_reads_the_remote_prefix_ahead_into_l1(
    redis_server: RedisServer, backend: RemoteBackend
) -> None:
    """Chunks a, b, c only in Redis: a LOOKUP finds them and starts reading them into L1 on the
    reader thread; the RETRIEVE that follows is served from L1 with Redis stopped (SIGSTOP),
    byte for byte, and no GET of its own."""
    keys = [bytes([i]) * 16 for i in range(3)]
    writer = TieredStore(1 << 20, remote=backend)  # another server's L1, sharing the Redis
    for i, k in enumerate(keys):
        _filled(writer, k, 10 + i)
    assert backend.flush(10)
    t = TieredStore(1 << 20, remote=backend)
    assert t.prefix_hits(keys) == 3
    deadline = time.monotonic() + 10
    while t.remote_read_ahead < 3 and time.monotonic() < deadline:
        threading.Event().wait(0.005)
    assert t.remote_read_ahead == 3 and t.promoted == 3
    gets = backend.stats().gets
    redis_server.pause()
    try:
        bufs = t.acquire_prefix(keys)
        assert [int(b[0]) for b in bufs] == [10, 11, 12]
        assert all(bool((b == 10 + i).all()) for i, b in enumerate(bufs))
        assert backend.stats().gets == gets  # served from L1: Redis was not asked
    finally:
        redis_server.resume()
    t.release(keys)


def test_a_read_queued_when_the_backend_stops_is_answered_none(redis_server: RedisServer) -> None:
    b = RemoteBackend(redis_server.url, timeout_s=2.0)
    answers: list[object] = []
    # not started: the read waits in the queue, and join (after stop) answers it
    assert b.get_later(b"x" * 16, "uint8", None, answers.append)
    b.stop()
    b.join(10)
    b.close()
    assert answers == [None]
    assert not b.get_later(b"y" * 16, "uint8", None, answers.append)  # stopped: refused
    assert answers == [None]
