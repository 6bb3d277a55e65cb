"""The management module's liveness role: PING, the reaper's lifecycle, status, release paths,
and the liveness settings. PING and disconnect detection over real sockets are in
`test_management_connections`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dataplane.liveness.target import InstanceLivenessTarget
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import RequestContext
from dataplane.modules.management import ManagementModule
from dataplane.modules.server_driven import ServerDrivenTransferModule
from dataplane.server.config import Settings
from dataplane.server.facade import LivenessStatus
from dataplane.server.loop import Server
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.storage.l1 import L1Store
from dataplane.wire.messages import MsgType, Unregister
from dataplane.wire.replies import PingReply
from tests.dataplane.fakes import BlendLike
from tests.dataplane.modules.management_support import (
    BOOT_TOKEN,
    CHUNK,
    T0,
    Caches,
    Running,
    call,
    engine_register,
    management,
    modules,
    ping_of,
    register,
    sample,
    server_info,
)
from tests.dataplane.registration import SECRET, register_message
from tests.helpers import FakeClock, free_port, wait_until


class TouchLog(InstanceLivenessTarget):
    """A target that only writes down the touches it gets."""

    def __init__(self) -> None:
        self.touches: list[tuple[int, int, bytes | None]] = []

    def touch_instance(self, instance_id: int, conn_fd: int = -1, secret: bytes | None = None) -> bool:
        self.touches.append((instance_id, conn_fd, secret))
        return False


@pytest.fixture
def metrics() -> DataPlaneMetrics:
    return DataPlaneMetrics()


def ping(mgmt: ManagementModule, instance_id: int | None, conn_fd: int = 9) -> dict[str, Any]:
    fn = mgmt.handlers()[MsgType.PING].fn
    out: dict[str, Any] = fn(RequestContext(3, MsgType.PING, conn_fd), ping_of(instance_id))
    return out


def reaper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvwarden-worker-reaper"]


# ------------------------------------------------------------------------------------ PING


def test_ping_touches_every_target_for_an_id(
    metrics: DataPlaneMetrics, make_caches: Callable[[], Caches]
) -> None:
    clock = FakeClock()
    sd, ed = modules(clock, metrics)
    log = TouchLog()
    mgmt = management([sd.registry, ed.registry, log, BlendLike()], metrics, clock=clock)
    try:
        register(sd, 7, make_caches())
        engine_register(ed, 7)
        clock.advance(30)
        assert ping(mgmt, 7, conn_fd=9) == PingReply(BOOT_TOKEN, True)
        for m in (sd, ed):
            e = m.registry.context_entry(7)
            assert e is not None
            assert (e.last_seen, e.has_liveness_signal, e.conn_fd) == (T0 + 30, True, 9)
        assert log.touches == [(7, 9, SECRET)]
        assert sample(metrics, "kvwarden_pings_total") == 1
    finally:
        sd.close()
        ed.close()


def test_ping_without_an_id_touches_nothing(
    metrics: DataPlaneMetrics, make_caches: Callable[[], Caches]
) -> None:
    clock = FakeClock()
    sd, ed = modules(clock, metrics)
    log = TouchLog()
    mgmt = management([sd.registry, ed.registry, log], metrics, clock=clock)
    try:
        register(sd, 7, make_caches())
        clock.advance(30)
        assert ping(mgmt, None) == PingReply(BOOT_TOKEN, None)
        e = sd.registry.context_entry(7)
        assert e is not None and (e.last_seen, e.has_liveness_signal) == (T0, False)
        assert log.touches == []
        assert sample(metrics, "kvwarden_pings_total") == 1
    finally:
        sd.close()
        ed.close()


def test_ping_of_an_unknown_id_answers_untracked_and_inserts_nothing(metrics: DataPlaneMetrics) -> None:
    sd, ed = modules(metrics=metrics)
    mgmt = management([sd.registry, ed.registry], metrics)
    assert ping(mgmt, 404) == PingReply(BOOT_TOKEN, False)
    assert sd.registry.tracked_instance_count() == ed.registry.tracked_instance_count() == 0
    no_targets = management([], metrics)
    assert ping(no_targets, 404).tracked is False


# ------------------------------------------------------------------------ reaper lifecycle


def test_timeout_zero_starts_no_reaper(metrics: DataPlaneMetrics) -> None:
    sd, ed = modules(metrics=metrics)
    mgmt = management([sd.registry, ed.registry], metrics, reap_timeout_s=0.0)
    before = len(reaper_threads())
    mgmt.start()
    assert mgmt.reaper is None and mgmt.reaper_alive() is None
    assert len(reaper_threads()) == before
    mgmt.stop()


def test_management_reaper_reaps_fans_out_and_counts(
    running: Callable[..., Running], make_caches: Callable[[], Caches]
) -> None:
    # The registries and the reaper read an injected clock: nothing is stale until the test
    # moves it, however slowly the machine runs; the thread still wakes every 0.1 s.
    clock = FakeClock()
    r = running(reap_timeout_s=0.4, registration_grace_s=0.4, clock=clock)
    assert r.management.reaper is not None and r.management.reaper_alive() is True
    assert any(t.is_alive() for t in reaper_threads())
    sock = r.dealer()
    call(sock, 1, register_message(7, make_caches()))
    assert call(sock, 2, ping_of(7))["tracked"] is True
    clock.advance(0.5)  # past the reap timeout of a pinged instance
    wait_until(lambda: r.blend.seen() == [7], 5, what="the reaper")
    assert r.transfer.registry.context_entry(7) is None
    assert r.management.releaser.reaped_total == 1
    assert sample(r.metrics, "kvwarden_instances_reaped_total", reason="timeout") == 1
    assert sample(r.metrics, "kvwarden_instances_reaped_total", reason="grace") == 0
    assert call(sock, 3, ping_of(7))["tracked"] is False  # the client will re-register


def test_shutdown_joins_the_reaper_before_any_module_clears_its_state(
    make_caches: Callable[[], Caches],
) -> None:
    seen_at_close: list[bool | None] = []

    class Probe(ServerDrivenTransferModule):
        mgmt: ManagementModule | None = None

        def close(self) -> None:
            assert self.mgmt is not None
            seen_at_close.append(self.mgmt.reaper_alive())
            super().close()

    server = Server("tcp://127.0.0.1:*")
    probe = Probe(L1Store(8 << 20), CHUNK, server.metrics)
    mgmt = management(
        [probe.registry],
        server.metrics,
        server_info(server),
        reap_timeout_s=60.0,
        registration_grace_s=60.0,
    )
    probe.mgmt = mgmt
    server.add_connection_listener(mgmt.on_connection)
    server.add_module(probe)  # added before management: the order of stop() must not matter
    server.add_module(mgmt)
    server.start()
    register(probe, 7, make_caches())
    assert mgmt.reaper_alive() is True
    assert server.stop(5.0)
    assert seen_at_close == [False]
    assert probe.registry.tracked_instance_count() == 0


# --------------------------------------------------------------------------------- status


@pytest.fixture
def assembled() -> Iterator[Callable[..., DataPlane]]:
    """Data planes assembled by ``build_dataplane`` with the liveness settings a test gives,
    started, and stopped after the test."""
    made: list[DataPlane] = []

    def make(**liveness: float) -> DataPlane:
        settings = Settings(
            port=free_port(), http_port=free_port(), chunk_size=CHUNK, l1_size_gb=0.01, **liveness
        )
        dp = build_dataplane(settings)
        made.append(dp)
        dp.start()
        return dp

    yield make
    for dp in made:
        assert dp.stop(), "data plane did not stop within its bound"


def test_liveness_status_summarises_liveness(
    assembled: Callable[..., DataPlane], make_caches: Callable[[], Caches]
) -> None:
    dp = assembled(
        worker_reap_timeout_seconds=120.0,
        worker_registration_grace_seconds=3600.0,
        worker_disconnect_grace_seconds=10.0,
    )
    register(dp.transfer, 1, make_caches())
    register(dp.transfer, 2, make_caches())
    engine_register(dp.engine, 3)
    status = dp.liveness_status()
    assert status == LivenessStatus(
        enabled=True,
        reap_timeout_seconds=120.0,
        registration_grace_seconds=3600.0,
        disconnect_grace_seconds=10.0,
        tracked_instances=3,
        reaped_total=0,
        # the rotation kernel is per process: compiled already when an earlier test blended
        blend_kernel=status.blend_kernel,
    )
    assert status.blend_kernel in ("idle", "compiling", "ready")
    assert dp.force_reap(2) == ["server_driven"]
    status = dp.liveness_status()
    assert (status.tracked_instances, status.reaped_total) == (2, 1)


def test_liveness_status_without_a_reap_timeout_is_disabled(assembled: Callable[..., DataPlane]) -> None:
    dp = assembled(worker_reap_timeout_seconds=0)
    assert dp.management.reaper is None and dp.liveness_status().enabled is False


# --------------------------------------------------------------------------- release paths


def test_unregister_runs_the_cleanup_and_is_idempotent(
    running: Callable[..., Running], make_caches: Callable[[], Caches]
) -> None:
    r = running()
    r.blend.state[7] = "rope-7"
    sock = r.dealer()
    call(sock, 1, register_message(7, make_caches()))
    assert call(sock, 2, Unregister(7, SECRET)) == {"removed": True}
    assert r.transfer.registry.context_entry(7) is None
    assert r.blend.state == {} and r.blend.seen() == [7]
    assert call(sock, 3, Unregister(7, SECRET)) == {"removed": False}
    assert r.blend.seen() == [7, 7]  # fanned out again: a no-op for an unknown id
    assert r.management.releaser.reaped_total == 0  # an UNREGISTER is not a reap


def test_force_reap_releases_everywhere_and_counts_as_admin(
    metrics: DataPlaneMetrics, make_caches: Callable[[], Caches]
) -> None:
    sd, ed = modules(metrics=metrics)
    blend = BlendLike((7, 8))
    mgmt = management([sd.registry, ed.registry, blend], metrics)
    try:
        register(sd, 7, make_caches())
        engine_register(ed, 7)
        assert sorted(mgmt.force_reap(7)) == ["engine_driven", "server_driven"]
        assert sd.registry.context_entry(7) is None and ed.registry.context_entry(7) is None
        assert blend.state == {8: "rope-8"}
        assert mgmt.releaser.reaped_total == 1
        assert sample(metrics, "kvwarden_instances_reaped_total", reason="admin") == 1
        assert mgmt.force_reap(7) == []
        assert mgmt.releaser.reaped_total == 1
    finally:
        sd.close()
        ed.close()
