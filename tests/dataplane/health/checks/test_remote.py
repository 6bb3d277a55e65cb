"""The remote backend check and the monitor against real redis-server processes: killed,
paused and restarted by the test; the recovery window on an injected clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dataplane.health.base import Components, FallbackPolicy, IrrecoverableException
from dataplane.health.checks.remote import RemoteBackendHealthCheck
from dataplane.health.monitor import HealthMonitor
from dataplane.storage.l1 import L1Store
from dataplane.storage.lower import OK, OTHER_ERROR, TIMEOUT
from dataplane.storage.remote import RemoteBackend
from tests.helpers import wait_until
from tests.redis_server import RedisServer

TIMEOUT_S = 0.3
SHAPE = (8,)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def backend(redis_server: RedisServer) -> Iterator[RemoteBackend]:
    b = RemoteBackend(redis_server.url, timeout_s=TIMEOUT_S, health_timeout_s=TIMEOUT_S)
    b.start()
    try:
        yield b
    finally:
        b.stop()
        b.join(10)
        b.close()


def _check(
    backend: RemoteBackend, clock: Clock, threshold: int = 5, wait: float = 30.0
) -> RemoteBackendHealthCheck:
    comps = Components(
        remote_backends={"redis": backend},
        get_blocking_failed_threshold=threshold,
        waiting_time_for_recovery=wait,
        clock=clock,
    )
    return RemoteBackendHealthCheck("redis", backend, comps)


def _fail_reads(backend: RemoteBackend, n: int) -> None:
    for i in range(n):
        assert backend.get(i.to_bytes(16, "big"), "uint8", SHAPE) is None


def test_ping_decides_health_when_nothing_tripped(backend: RemoteBackend, redis_server: RedisServer) -> None:
    chk = _check(backend, Clock())
    assert chk.check() and backend.stats().ping_code == OK and backend.stats().ping_latency_s > 0
    redis_server.kill()
    assert not chk.check() and backend.stats().ping_code == OTHER_ERROR
    redis_server.start()
    assert chk.check()  # nothing tripped: no recovery window
    redis_server.pause()
    try:
        # the PING gave up at its timeout (TIMEOUT, not an answer or a hang)
        assert not chk.check() and backend.stats().ping_code == TIMEOUT
        assert "timed out" in chk.reason()
    finally:
        redis_server.resume()
    assert chk.check()


def test_a_cold_cache_full_of_misses_never_trips(backend: RemoteBackend) -> None:
    chk = _check(backend, Clock(), threshold=3)
    _fail_reads(backend, 100)  # plain misses: Redis answered "no such key"
    assert chk.check() and chk.failed_at is None and backend.stats().misses == 100


def test_tripped_counter_waits_out_the_window_and_recovers_only_through_the_probe(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    clock = Clock()
    chk = _check(backend, clock, threshold=3, wait=30.0)
    redis_server.kill()
    _fail_reads(backend, 3)  # connection errors: failures
    assert not chk.check() and chk.failed_at == clock.now and "3 failed reads" in chk.reason()
    redis_server.start()
    clock.now += 10
    assert not chk.check() and "recovery window" in chk.reason()  # Redis is back; the window is not over
    redis_server.kill()
    clock.now += 25  # the window is over, but the probe cannot round-trip
    assert not chk.check() and "probe" in chk.reason() and chk.failed_at is not None
    redis_server.start()
    assert chk.check() and chk.failed_at is None  # probe round-tripped: healthy, window cleared
    assert not redis_server.client().keys("kvwarden:probe:*")  # the probe cleans up after itself


def test_refused_credentials_are_irrecoverable() -> None:
    r = RedisServer(extra=["--requirepass", "right"])
    b = RemoteBackend(r.url, password="wrong", timeout_s=TIMEOUT_S)
    try:
        m = HealthMonitor(Components(remote_backends={"redis": b}), ping_interval=0.05)
        m.start()
        wait_until(lambda: not m.is_alive(), 10, what="the monitor to stop")
        assert not m.is_healthy() and "refused the credentials" in str(m.summary_state().irrecoverable)
        with pytest.raises(IrrecoverableException):
            _check(b, Clock()).check()
    finally:
        b.close()
        r.stop()


def test_recompute_detects_a_killed_redis_within_interval_plus_timeout(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    interval = 0.5
    m = HealthMonitor(Components(remote_backends={"redis": backend}), ping_interval=interval)
    m.start()
    try:
        wait_until(lambda: m.summary_state().rounds >= 1, 10, what="the first round")
        assert m.is_healthy()
        redis_server.kill()
        killed_at = m.summary_state().rounds
        # a round every interval, each bounded by TIMEOUT_S: the first round begun after the kill
        # turns the server unhealthy (counted in rounds, on one snapshot: no stopwatch)
        st = wait_until(
            lambda: s if not (s := m.summary_state()).healthy else None, 10, interval=0.01, what="unhealthy"
        )
        assert st.rounds <= killed_at + 2, (killed_at, st.rounds)
        redis_server.start()
        wait_until(m.is_healthy, 10, interval=0.01, what="healthy again")
    finally:
        m.stop()
        m.join(10)


def test_a_burst_of_failed_reads_runs_a_round_at_once(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    comps = Components(remote_backends={"redis": backend}, get_blocking_failed_threshold=3)
    m = HealthMonitor(comps, ping_interval=600.0)
    backend.burst_at, backend.on_burst = 3, m.request_round
    m.start()
    try:
        wait_until(lambda: m.summary_state().rounds >= 1, 10, what="the first round")
        redis_server.kill()
        _fail_reads(backend, 3)
        wait_until(lambda: not m.is_healthy(), 5, interval=0.01, what="the burst's round")
    finally:
        m.stop()
        m.join(10)


def test_local_cpu_keeps_serving_from_l1_while_redis_is_away(
    backend: RemoteBackend, redis_server: RedisServer
) -> None:
    l1 = L1Store(1 << 20, hot_cache=False)
    comps = Components(
        remote_backends={"redis": backend}, local_tier=l1, fallback_policy=FallbackPolicy.LOCAL_CPU
    )
    m = HealthMonitor(comps, ping_interval=60.0)
    assert m.run_round()
    redis_server.kill()
    assert m.run_round() and backend.bypassed and l1.hot_cache
    assert m.bypassed() == {"redis": m.checks[0].name()}
    redis_server.start()
    assert m.run_round() and not backend.bypassed and not l1.hot_cache
