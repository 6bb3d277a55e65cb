"""The remote tier against a real redis-server with ``maxmemory 1mb`` and ``noeviction``: Redis
answering OOM stops writes (dropped, counted), never reads, and never fails the health check;
writes resume once Redis has room again."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from dataplane.health.base import Components
from dataplane.health.monitor import HealthMonitor
from dataplane.storage.remote import RemoteBackend
from tests.helpers import FakeClock
from tests.redis_server import RedisServer

SMALL, BIG = (4, 16, 64), (8, 256, 256)  # bfloat16: 8 KiB, 1 MiB


def nbytes(shape: tuple[int, ...]) -> int:
    n = 2
    for d in shape:
        n *= d
    return n


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture
def full_redis() -> Iterator[RedisServer]:
    r = RedisServer(extra=["--maxmemory-policy", "noeviction"])  # maxmemory 1mb once set up
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture
def clock() -> FakeClock:
    """The backend's clock: moved by the test (the one write a second let through as a try)."""
    return FakeClock()


@pytest.fixture
def backend(full_redis: RedisServer, clock: FakeClock) -> Iterator[RemoteBackend]:
    b = RemoteBackend(full_redis.url, timeout_s=2.0, queue_bytes=64 << 20, clock=clock)
    b.start()
    try:
        yield b
    finally:
        b.stop()
        b.join(10)
        b.close()


def test_redis_out_of_memory_stops_writes_keeps_reads_and_resumes(
    full_redis: RedisServer, backend: RemoteBackend, clock: FakeClock
) -> None:
    small = memoryview(os.urandom(nbytes(SMALL)))
    assert backend.put(key(0), "bfloat16", SMALL, small) and backend.flush(10)
    assert backend.stats().puts == 1  # no maxmemory yet: written
    with full_redis.client() as c:
        c.config_set("maxmemory", "1mb")
    bigs = [memoryview(os.urandom(nbytes(BIG))) for _ in range(4)]
    for i, b in enumerate(bigs, 1):  # once the writer has met OOM: refused, or this second's try
        backend.put(key(i), "bfloat16", BIG, b)
    assert backend.flush(10)
    s = backend.stats()
    assert s.space.out_of_space and "OOM" in s.space.reason and s.space.episodes == 1
    assert s.put_failures["no_space"] == 1 and s.put_failures["error"] == 0
    written = s.puts - 1  # Redis may take one big value while under maxmemory, never two
    assert written in (0, 1) and s.drops["no_space"] == 4 - written
    clock.advance(1.0)  # (a put above may have been this second's try)
    assert backend.put(key(9), "bfloat16", BIG, bigs[0]) and backend.flush(10)  # a try: no room
    assert backend.stats().drops["no_space"] == 5 - written and backend.stats().put_failures["no_space"] == 1
    assert not backend.put(key(9), "bfloat16", BIG, bigs[0])  # refused at once: the try is spent
    assert backend.stats().drops["no_space"] == 6 - written
    assert backend.take_failed_gets() == 0
    got = backend.get(key(0), "bfloat16", SMALL)  # reads go on
    assert got is not None and bytes(got) == bytes(small)
    for i in range(1 + written, 5):
        assert backend.get(key(i), "bfloat16", BIG) is None  # never written: a miss

    monitor = HealthMonitor(Components(remote_backends={"redis": backend}), ping_interval=60)
    assert monitor.run_round() and monitor.is_healthy()
    (result,) = monitor.results()
    assert result.status == "warn" and "out of space" in result.reason
    assert monitor.run_round() and backend.stats().space.out_of_space  # no room yet: stays out

    with full_redis.client() as c:
        c.config_set("maxmemory", "0")  # room again: the next health round resumes writes
    assert monitor.run_round() and monitor.results()[0].status == "pass"
    assert not backend.stats().space.out_of_space
    assert backend.put(key(5), "bfloat16", BIG, bigs[3]) and backend.flush(10)
    got = backend.get(key(5), "bfloat16", BIG)
    assert got is not None and bytes(got) == bytes(bigs[3])


def test_a_write_let_through_as_a_try_resumes_writes_once_redis_has_room(
    full_redis: RedisServer, backend: RemoteBackend, clock: FakeClock
) -> None:
    with full_redis.client() as c:
        c.set("filler", os.urandom(1 << 20))
        c.config_set("maxmemory", "1mb")
    big = memoryview(os.urandom(nbytes(BIG)))
    assert backend.put(key(1), "bfloat16", BIG, big) and backend.flush(10)
    assert backend.stats().space.out_of_space
    assert backend.put(key(2), "bfloat16", BIG, big) and backend.flush(10)  # a try: no room, dropped
    with full_redis.client() as c:
        c.delete("filler")
        c.config_set("maxmemory", "64mb")  # room again; no health round runs here
    assert not backend.put(key(2), "bfloat16", BIG, big)  # the try of this second is spent
    assert backend.stats().puts == 0 and backend.stats().space.out_of_space
    clock.advance(1.0)
    assert backend.put(key(3), "bfloat16", BIG, big) and backend.flush(10)  # a try, and it lands
    assert not backend.stats().space.out_of_space and backend.stats().space.episodes == 1
    got = backend.get(key(3), "bfloat16", BIG)
    assert got is not None and bytes(got) == bytes(big)


def test_a_probe_refused_for_memory_is_an_answer_not_an_outage(
    full_redis: RedisServer, backend: RemoteBackend
) -> None:
    with full_redis.client() as c:  # past maxmemory: a filler, then the limit
        c.set("filler", os.urandom(1 << 20))
        c.config_set("maxmemory", "1mb")
    assert backend.probe()  # Redis answered OOM: reachable, out of space
    assert backend.stats().space.out_of_space and "probe" in backend.stats().space.reason
    small = memoryview(os.urandom(nbytes(SMALL)))
    assert backend.put(key(1), "bfloat16", SMALL, small) and backend.flush(10)  # a try: no room shown
    assert not backend.put(key(2), "bfloat16", SMALL, small)  # refused at once
    s = backend.stats()
    assert s.drops["no_space"] == 2 and s.put_failures["no_space"] == 0 and s.puts == 0
