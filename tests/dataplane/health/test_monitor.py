"""HealthMonitor: rounds, both fallback policies with their exact transitions, irrecoverable and
init failures, discovery and the thread's lifecycle. Checks here are toggles (the seam the
monitor already has: `HealthCheck`); the local tier is a real L1Store; rounds are run directly
where timing is not the point."""

from __future__ import annotations

import logging
import threading

import pytest

from dataplane.health.base import Components, FallbackPolicy, HealthCheck, IrrecoverableException
from dataplane.health.checks.remote import RemoteBackendHealthCheck
from dataplane.health.checks.selfchecks import DataPlaneSelfCheck
from dataplane.health.monitor import HealthMonitor, discover
from dataplane.storage.l1 import L1Store
from dataplane.storage.remote import RemoteBackend
from tests.helpers import wait_until


class Toggle(HealthCheck):
    def __init__(
        self,
        name: str,
        policy: FallbackPolicy = FallbackPolicy.RECOMPUTE,
        backend: str | None = None,
    ) -> None:
        self._name, self._policy, self._backend = name, policy, backend
        self.ok = True
        self.skip = False
        self.raises: Exception | None = None
        self.calls = 0

    def name(self) -> str:
        return self._name

    def check(self) -> bool:
        self.calls += 1
        if self.raises is not None:
            raise self.raises
        return self.ok

    @property
    def fallback_policy(self) -> FallbackPolicy:
        return self._policy

    def should_skip(self) -> bool:
        return self.skip

    def get_bypass_backend_name(self) -> str | None:
        return self._backend


def _monitor(*checks: HealthCheck, tier: L1Store | None = None) -> HealthMonitor:
    return HealthMonitor(Components(local_tier=tier), ping_interval=60.0, checks=list(checks))


def _fill(l1: L1Store, n: int) -> None:
    for i in range(n):
        buf = l1.reserve(4096)
        assert buf is not None
        assert l1.commit(i.to_bytes(16, "big"), buf)


# ------------------------------------------------------------------ recompute


def test_starts_healthy_and_follows_a_recompute_check_both_ways() -> None:
    a, b = Toggle("a"), Toggle("b")
    m = _monitor(a, b)
    assert m.is_healthy()
    assert m.run_round()
    b.ok = False
    assert not m.run_round() and not m.is_healthy()
    assert {r.name: r.healthy for r in m.results()} == {"a": True, "b": False}
    b.ok = True
    assert m.run_round() and m.is_healthy()


def test_a_skipped_failing_check_does_not_count_and_an_exception_is_a_failure() -> None:
    a = Toggle("a")
    a.ok, a.skip = False, True
    m = _monitor(a)
    assert m.run_round() and a.calls == 0 and m.results()[0].skipped
    a.skip, a.ok = False, True
    a.raises = RuntimeError("boom")
    assert not m.run_round()
    assert "RuntimeError: boom" in m.results()[0].reason


def test_irrecoverable_stops_later_checks_and_leaves_the_server_unhealthy(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = Toggle("a"), Toggle("b")
    a.raises = IrrecoverableException("credentials refused")
    m = _monitor(a, b)
    with caplog.at_level(logging.ERROR), pytest.raises(IrrecoverableException):
        m.run_round()
    assert b.calls == 0 and not m.is_healthy()
    assert sum("irrecoverably" in r.message for r in caplog.records) == 1
    a.raises = None
    m.run_round()
    assert not m.is_healthy()  # for good


def test_the_thread_stops_after_exactly_one_irrecoverable_call() -> None:
    a = Toggle("a")
    a.raises = IrrecoverableException("no")
    m = HealthMonitor(Components(), ping_interval=0.01, checks=[a])
    m.start()
    wait_until(lambda: not m.is_alive(), 10, what="the monitor thread to stop")
    assert a.calls == 1 and not m.is_healthy()


def test_an_ordinary_exception_does_not_stop_the_thread() -> None:
    a = Toggle("a")
    a.raises = ValueError("flaky")
    m = HealthMonitor(Components(), ping_interval=0.01, checks=[a])
    m.start()
    try:
        wait_until(lambda: a.calls >= 3, 10, what="three rounds")
        assert m.is_alive() and not m.is_healthy()
        a.raises = None
        wait_until(m.is_healthy, 10, what="healthy again")
    finally:
        m.stop()
        m.join(10)
    assert not m.is_alive()


def test_no_checks_no_thread_and_init_failure_is_for_good() -> None:
    m = _monitor()
    m.start()
    assert not m.is_alive() and m.is_healthy()
    a = Toggle("a")
    m2 = _monitor(a)
    m2.mark_init_failed("L1 could not be reserved")
    m2.start()
    assert not m2.is_alive() and not m2.is_healthy()
    assert m2.run_round() is False and m2.summary_state().init_failure == "L1 could not be reserved"


def test_request_round_runs_one_at_once() -> None:
    a = Toggle("a")
    m = HealthMonitor(Components(), ping_interval=600.0, checks=[a])
    m.start()
    try:
        wait_until(lambda: a.calls == 1, 10, what="the first round")
        a.ok = False
        m.request_round()  # not 600 s later
        wait_until(lambda: not m.is_healthy(), 10, what="the extra round")
    finally:
        m.stop()
        m.join(10)


def test_health_reads_from_many_threads_while_it_changes() -> None:
    a = Toggle("a")
    m = _monitor(a)
    seen: list[bool] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append(m.is_healthy())
            m.summary_state()

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    states = set()
    for i in range(60):
        a.ok = bool(i % 2)
        m.run_round()
        states.add(m.is_healthy())
        n = len(seen)  # five more reads: at least one began after this round (four readers)
        wait_until(lambda n=n: len(seen) > n + 4, 10, what="the readers to read this round's state")
    stop.set()
    for t in threads:
        t.join(10)
    assert states == {True, False}  # the state did change
    assert True in seen and False in seen  # and the readers saw it change


# ------------------------------------------------------------------ local_cpu


def test_local_cpu_bypasses_keeps_healthy_and_recovery_restores_and_empties_l1() -> None:
    l1 = L1Store(1 << 20, hot_cache=False)
    r = Toggle("redis", FallbackPolicy.LOCAL_CPU, backend="redis")
    m = _monitor(r, tier=l1)
    r.ok = False
    assert m.run_round()  # still healthy
    assert m.bypassed() == {"redis": "redis"} and l1.hot_cache
    _fill(l1, 5)  # chunks cached while the remote tier was away
    m.run_round()  # repeated failures bypass once
    assert m.bypassed() == {"redis": "redis"}
    r.ok = True
    assert m.run_round()
    assert m.bypassed() == {} and not l1.hot_cache
    assert l1.stats().chunks == 0  # not served as if the remote held them


def test_local_cpu_recovery_keeps_l1_when_hot_cache_was_on() -> None:
    l1 = L1Store(1 << 20, hot_cache=True)
    r = Toggle("redis", FallbackPolicy.LOCAL_CPU, backend="redis")
    m = _monitor(r, tier=l1)
    r.ok = False
    m.run_round()
    _fill(l1, 3)
    r.ok = True
    m.run_round()
    assert l1.hot_cache and l1.stats().chunks == 3


def test_two_backends_save_once_and_restore_after_the_last_recovers() -> None:
    l1 = L1Store(1 << 20, hot_cache=False)
    a = Toggle("a", FallbackPolicy.LOCAL_CPU, backend="a")
    b = Toggle("b", FallbackPolicy.LOCAL_CPU, backend="b")
    m = _monitor(a, b, tier=l1)
    a.ok = False
    m.run_round()
    b.ok = False
    m.run_round()  # the saved setting is still the original (off), not the fallback's (on)
    assert set(m.bypassed()) == {"a", "b"} and l1.hot_cache
    a.ok = True
    m.run_round()
    assert set(m.bypassed()) == {"b"} and l1.hot_cache  # b is still away
    b.ok = True
    m.run_round()
    assert m.bypassed() == {} and not l1.hot_cache


def test_bypass_reaches_the_backend_object() -> None:
    backend = RemoteBackend("redis://127.0.0.1:1/0", timeout_s=0.2)  # never connected here
    r = Toggle("redis", FallbackPolicy.LOCAL_CPU, backend="redis")
    m = HealthMonitor(Components(remote_backends={"redis": backend}), 60.0, checks=[r])
    r.ok = False
    m.run_round()
    assert backend.bypassed
    r.ok = True
    m.run_round()
    assert not backend.bypassed
    backend.close()


# ------------------------------------------------------------------ discovery


def test_discovery_creates_one_remote_check_per_backend_and_the_self_checks() -> None:
    assert discover(Components()) == []
    b1 = RemoteBackend("redis://:pw@127.0.0.1:1/0", timeout_s=0.2)
    b2 = RemoteBackend("redis://127.0.0.1:2/0", timeout_s=0.2)
    comps = Components(remote_backends={"r1": b1, "r2": b2}, self_checks={"loop": lambda: True})
    checks = discover(comps)
    remote = [c for c in checks if isinstance(c, RemoteBackendHealthCheck)]
    assert sorted(c.get_bypass_backend_name() or "" for c in remote) == ["r1", "r2"]
    assert all("pw" not in c.name() and "127.0.0.1" in c.name() for c in remote)
    assert [c.name() for c in checks if isinstance(c, DataPlaneSelfCheck)] == ["loop"]
    for b in (b1, b2):
        b.close()


def test_discovery_skips_a_create_that_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cls: type, components: Components) -> list[HealthCheck]:
        raise RuntimeError("cannot create")

    monkeypatch.setattr(DataPlaneSelfCheck, "create", classmethod(broken))
    checks = discover(Components(self_checks={"loop": lambda: True}))
    assert checks == []


def test_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="ping_interval must be > 0"):
        HealthMonitor(Components(), ping_interval=0, checks=[])
    m = _monitor(Toggle("a"))
    m.start()
    with pytest.raises(RuntimeError, match="already started"):
        m.start()
    m.stop()
    m.join(10)
    assert not m.is_alive()


class LiveToggle(Toggle):
    live = True


def test_live_checks_are_read_at_once_and_need_no_thread() -> None:
    loop, remote = LiveToggle("dataplane:loop"), Toggle("remote")
    m = _monitor(loop)
    m.start()
    assert not m.is_alive()  # only live checks: no rounds to run
    assert m.is_healthy()
    loop.ok = False
    assert not m.is_healthy()  # no round ran: read when asked
    assert [(r.name, r.healthy) for r in m.summary_state().results] == [("dataplane:loop", False)]
    loop.ok = True
    assert m.is_healthy()
    m2 = _monitor(loop, remote)
    m2.run_round()
    assert remote.calls == 1 and loop.calls > 0
    calls = loop.calls
    m2.run_round()
    assert loop.calls == calls + 1  # a round's result folds in the live checks once
    loop.raises = RuntimeError("flag unreadable")
    assert not m2.is_healthy()
    assert "RuntimeError" in next(r.reason for r in m2.summary_state().results if r.name == "dataplane:loop")
