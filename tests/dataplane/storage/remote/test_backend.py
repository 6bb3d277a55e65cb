"""RemoteBackend against real redis-server processes started here on free loopback ports:
round trips, damaged values never served, bounded calls while Redis hangs (SIGSTOP) or is gone
(SIGKILL), the write-behind queue, credentials kept out of sight."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from dataplane.storage.codec import encode
from dataplane.storage.lower import OK, OTHER_ERROR, TIMEOUT
from dataplane.storage.remote import RemoteAuthError, RemoteBackend
from dataplane.storage.remote.redis_client import redact
from tests.helpers import wait_until
from tests.redis_server import RedisServer

SHAPE = (4, 16, 64)  # bfloat16: 8 KiB
NBYTES = 4 * 16 * 64 * 2
TIMEOUT_S = 0.3


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _payload() -> memoryview:
    return memoryview(os.urandom(NBYTES))


@pytest.fixture
def backend(redis_server: RedisServer) -> Iterator[RemoteBackend]:
    b = RemoteBackend(redis_server.url, timeout_s=TIMEOUT_S, queue_bytes=4 * NBYTES)
    b.start()
    try:
        yield b
    finally:
        b.stop()
        b.join(10)
        b.close()


class _Done:
    """Counts `done` callbacks (each write must be released exactly once)."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()

    def __call__(self) -> None:
        with self.lock:
            self.n += 1


def test_round_trip_and_counters(backend: RemoteBackend) -> None:
    data, done = _payload(), _Done()
    assert backend.put(_key(1), "bfloat16", SHAPE, data, done)
    assert backend.flush(10) and done.n == 1
    got = backend.get(_key(1), "bfloat16", SHAPE)
    assert got is not None and bytes(got) == bytes(data)
    assert backend.get(_key(2), "bfloat16", SHAPE) is None
    s = backend.stats()
    assert (s.puts, s.gets, s.hits, s.misses, s.bytes_read) == (1, 2, 1, 1, NBYTES)
    assert s.bytes_written > NBYTES and sum(s.get_failures.values()) == 0
    assert backend.take_failed_gets() == 0  # a miss is not a failure


def test_count_prefix_stops_at_the_first_gap(backend: RemoteBackend) -> None:
    for i in (0, 1, 2, 4):
        backend.put(_key(i), "bfloat16", SHAPE, _payload())
        assert backend.flush(10)  # the queue holds four chunks at most
    assert backend.count_prefix([_key(i) for i in range(6)]) == 3
    assert backend.count_prefix([_key(3), _key(4)]) == 0
    assert backend.count_prefix([]) == 0


def test_damaged_or_foreign_values_are_counted_misses(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    good = encode(_key(1), "bfloat16", SHAPE, bytes(_payload()))
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x40
    planted = {
        _key(10): good[: len(good) - 100],  # truncated
        _key(11): bytes(flipped),  # one byte flipped
        _key(12): good,  # another key's bytes
        _key(13): b"a value some other program SET under our prefix",
    }
    raw = redis_server.client()
    for k, v in planted.items():
        raw.set(backend.redis_key(k), v)
    raw.close()
    for k in planted:
        assert backend.get(k, "bfloat16", SHAPE) is None
    assert backend.get(_key(12), "bfloat16", (8, 16, 32)) is None
    s = backend.stats()
    assert s.bad_values == {"truncated": 1, "checksum": 1, "key": 2, "format": 1}
    assert s.misses == 5 and s.hits == 0 and backend.take_failed_gets() == 0


def test_a_hung_redis_bounds_every_call_and_put_never_waits(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    backend.put(_key(1), "bfloat16", SHAPE, _payload())
    assert backend.flush(10)
    redis_server.pause()  # SIGSTOP: connections accepted, nothing answered
    try:
        for n, call in enumerate(
            (
                lambda: backend.get(_key(1), "bfloat16", SHAPE),
                lambda: backend.count_prefix([_key(1)]),
            ),
            start=1,
        ):
            # each call gave up at its timeout (counted as a timeout, not waited out)
            assert not call()
            assert backend.stats().get_failures["timeout"] == n
        _, code = backend.ping()
        assert code == TIMEOUT
        done = _Done()
        # the writer is stuck on Redis; put is not: past the queue's room it refuses (a "full"
        # drop) instead of waiting for the writer to make room
        accepted = [backend.put(_key(100 + i), "bfloat16", SHAPE, _payload(), done) for i in range(10)]
        assert not all(accepted) and backend.stats().drops["full"] >= 5
        assert backend.stats().drops["full"] == accepted.count(False), (accepted, backend.stats().drops)
        assert backend.take_failed_gets() == 2 and backend.stats().get_failures["timeout"] == 2
    finally:
        redis_server.resume()
    assert backend.flush(10)  # after SIGCONT nothing stays blocked: the queue drains
    assert done.n == 10 and backend.is_alive()
    assert backend.get(_key(1), "bfloat16", SHAPE) is not None


def test_a_killed_redis_fails_fast_and_a_restarted_one_is_used_again(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    redis_server.kill()
    assert backend.get(_key(1), "bfloat16", SHAPE) is None
    assert backend.ping()[1] == OTHER_ERROR
    # refused at once: a connection failure, not a timeout waited out
    assert backend.stats().get_failures["connection"] == 1
    assert backend.stats().get_failures["timeout"] == 0
    backend.put(_key(1), "bfloat16", SHAPE, _payload())
    wait_until(lambda: backend.stats().put_failures["connection"] == 1, 10, what="the failed write")
    redis_server.start()  # the same port
    assert backend.ping()[1] == OK
    data = _payload()
    backend.put(_key(2), "bfloat16", SHAPE, data)
    assert backend.flush(10)
    got = backend.get(_key(2), "bfloat16", SHAPE)
    assert got is not None and bytes(got) == bytes(data)


def test_bypassed_backend_neither_reads_nor_writes(backend: RemoteBackend) -> None:
    backend.put(_key(1), "bfloat16", SHAPE, _payload())
    assert backend.flush(10)
    backend.bypassed = True
    done = _Done()
    assert not backend.put(_key(2), "bfloat16", SHAPE, _payload(), done) and done.n == 1
    assert backend.get(_key(1), "bfloat16", SHAPE) is None and backend.count_prefix([_key(1)]) == 0
    s = backend.stats()
    assert s.drops["bypassed"] == 1 and s.gets == 0 and backend.take_failed_gets() == 0


def test_stop_drops_what_is_queued_and_releases_it(redis_server: RedisServer) -> None:
    b = RemoteBackend(redis_server.url, timeout_s=TIMEOUT_S, queue_bytes=64 * NBYTES)
    b.start()
    done = _Done()
    redis_server.pause()
    try:
        for i in range(5):
            assert b.put(_key(i), "bfloat16", SHAPE, _payload(), done)
        b.stop()
        b.join(10)
    finally:
        redis_server.resume()
    assert not b.is_alive() and done.n == 5
    assert b.stats().drops["stopped"] >= 3  # one may have been on the wire (failed, released)
    assert not b.put(_key(9), "bfloat16", SHAPE, _payload(), done) and done.n == 6
    b.close()


def test_credentials_are_refused_loudly_and_never_shown() -> None:
    r = RedisServer(extra=["--requirepass", "s3cret-pw"])
    try:
        wrong = RemoteBackend(r.url, password="not-it", timeout_s=TIMEOUT_S)
        with pytest.raises(RemoteAuthError) as e:
            wrong.ping()
        assert "s3cret" not in str(e.value) and "not-it" not in str(e.value)
        assert wrong.get(_key(1), "bfloat16", SHAPE) is None
        assert wrong.stats().get_failures["auth"] == 1
        wrong.close()
        right = RemoteBackend(f"redis://:s3cret-pw@127.0.0.1:{r.port}/0", timeout_s=TIMEOUT_S)
        assert right.ping()[1] == OK and "s3cret" not in right.url and "***" in right.url
        right.close()
    finally:
        r.stop()


def test_redact_keeps_everything_but_the_password() -> None:
    assert redact("redis://u:pw@h:6379/2") == "redis://u:***@h:6379/2"
    assert redact("rediss://:pw@[::1]:6380/0") == "rediss://:***@[::1]:6380/0"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
    with pytest.raises(ValueError, match="must be > 0"):
        RemoteBackend("redis://127.0.0.1:1/0", timeout_s=0)
