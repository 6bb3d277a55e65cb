"""The worker reaper: its pure step on a fake clock, and its thread on a short real interval.

Targets are the registries of the real transfer modules holding real shared memory, plus a
blend-like target that overrides only ``drop_instance_state`` (the role the liveness protocol
gives per-instance side state), so the fan-out is observed where it lands. The reaper sends
what it reaps down the one release path (`InstanceReleaser`), which counts it by reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from dataplane.client import allocate_kv_caches, free_kv_caches
from dataplane.liveness.entry import Entry, InstanceInfo
from dataplane.liveness.reaper import WorkerReaper
from dataplane.liveness.registry import LivenessRegistry
from dataplane.liveness.release import InstanceReleaser
from dataplane.liveness.target import InstanceLivenessTarget, Reaped
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import RequestContext
from dataplane.modules.engine_pool import EngineDrivenTransferModule
from dataplane.modules.server_driven import CacheContext, ServerDrivenTransferModule
from dataplane.storage.l1 import L1Store
from dataplane.wire.messages import Message, MsgType
from tests.dataplane.fakes import BlendLike
from tests.dataplane.registration import engine_register_message, register_message
from tests.helpers import FakeClock, wait_until

CHUNK = 16
T0 = 1000.0
TIMEOUT, GRACE, DISCONNECT = 120.0, 3600.0, 10.0
Clock = Callable[[], float]
Module = ServerDrivenTransferModule | EngineDrivenTransferModule


class StuckTransfer(ServerDrivenTransferModule):
    """Releasing instance ``stuck_id`` blocks until ``unblock`` is set; ``left`` is set once
    that release returns."""

    def __init__(self, clock: Clock, stuck_id: int) -> None:
        super().__init__(L1Store(8 << 20), CHUNK, DataPlaneMetrics(), clock, release_timeout_s=0.2)
        self.stuck_id = stuck_id
        self.entered = threading.Event()
        self.unblock = threading.Event()
        self.left = threading.Event()

    def _release(self, c: CacheContext, why: str) -> None:
        if c.instance_id == self.stuck_id:
            self.entered.set()
            self.unblock.wait(30)
        super()._release(c, why)
        if c.instance_id == self.stuck_id:
            self.left.set()


@pytest.fixture
def caches() -> Iterator[list[torch.Tensor]]:
    c = allocate_kv_caches(2, 16, 16, 2, 8, torch.bfloat16)
    yield c
    free_kv_caches(c)


@pytest.fixture
def modules() -> Iterator[Callable[[Clock], tuple[ServerDrivenTransferModule, EngineDrivenTransferModule]]]:
    made: list[Module] = []

    def make(clock: Clock) -> tuple[ServerDrivenTransferModule, EngineDrivenTransferModule]:
        l1, metrics = L1Store(8 << 20), DataPlaneMetrics()
        pair = (
            ServerDrivenTransferModule(l1, CHUNK, metrics, clock),
            EngineDrivenTransferModule(l1, CHUNK, metrics, clock),
        )
        made.extend(pair)
        return pair

    yield make
    for m in made:
        m.close()


def register(m: Module, instance_id: int, caches: list[torch.Tensor], conn_fd: int = 5) -> None:
    msg: Message
    if isinstance(m, EngineDrivenTransferModule):
        mtype, msg = MsgType.ENGINE_REGISTER, engine_register_message(instance_id)
    else:
        mtype, msg = MsgType.REGISTER_KV_CACHE, register_message(instance_id, caches)
    out = m.handlers()[mtype].fn(RequestContext(1, mtype, conn_fd), msg)
    assert out.created is True


def reaper_of(
    targets: Sequence[InstanceLivenessTarget],
    timeout_s: float,
    grace_s: float,
    disconnect_s: float,
    clock: Clock = time.monotonic,
    metrics: DataPlaneMetrics | None = None,
) -> WorkerReaper:
    """A reaper whose release path reaches ``targets``."""
    releaser = InstanceReleaser(targets, metrics or DataPlaneMetrics())
    return WorkerReaper(releaser, timeout_s, grace_s, disconnect_s, clock)


def reaped_count(metrics: DataPlaneMetrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value("kvwarden_instances_reaped_total", {"reason": reason})


def reaper_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvwarden-worker-reaper"]


# ------------------------------------------------------------------------ the pure step


def test_reap_once_reaps_every_target_and_fans_out_drop_instance_state(
    clock: FakeClock, modules: Any, caches: list[torch.Tensor]
) -> None:
    sd, ed = modules(clock)
    blend = BlendLike([1, 2, 3])
    register(sd, 1, caches)
    register(ed, 2, caches)
    register(sd, 3, caches)
    sd.registry.touch_instance(1)
    ed.registry.touch_instance(2)
    clock.advance(TIMEOUT + 1)
    sd.registry.touch_instance(3)
    metrics = DataPlaneMetrics()
    reaper = reaper_of([sd.registry, ed.registry, blend], TIMEOUT, GRACE, DISCONNECT, clock, metrics)
    assert sorted(reaper.reap_once()) == [1, 2]
    assert sorted(blend.seen()) == [1, 2] and blend.state == {3: "rope-3"}
    # what the reaped callback reported is now counted by the release path, by reason
    assert reaper.releaser.reaped_total == 2 and reaped_count(metrics, "timeout") == 2
    assert sd.registry.tracked_instance_count() == 1 and ed.registry.tracked_instance_count() == 0
    assert reaper.reap_once() == [] and sorted(blend.seen()) == [1, 2]  # nothing twice
    assert reaper.releaser.reaped_total == 2 and reaped_count(metrics, "timeout") == 2


def test_drop_instance_state_for_an_unknown_id_is_a_no_op(clock: FakeClock, modules: Any) -> None:
    sd, ed = modules(clock)
    blend = BlendLike([5])
    for t in (sd.registry, ed.registry, blend, InstanceLivenessTarget()):
        t.drop_instance_state(404)
    assert blend.state == {5: "rope-5"}
    assert InstanceLivenessTarget().reap_stale_instances(0, 0) == []
    assert InstanceLivenessTarget().tracked_instance_count() == 0


@pytest.mark.parametrize("kind", ["server_driven", "engine_driven"])
@pytest.mark.parametrize("window", ["timeout", "grace", "disconnect"])
def test_each_window_reaps_only_strictly_after_it(
    clock: FakeClock, modules: Any, caches: list[torch.Tensor], kind: str, window: str
) -> None:
    sd, ed = modules(clock)
    m = sd if kind == "server_driven" else ed
    blend = BlendLike([7])
    register(m, 7, caches, conn_fd=20)
    if window != "grace":
        m.registry.touch_instance(7)
    if window == "disconnect":
        assert m.registry.mark_connection_closed(20, clock()) == 1
    span = {"timeout": TIMEOUT, "grace": GRACE, "disconnect": DISCONNECT}[window]
    metrics = DataPlaneMetrics()
    reaper = reaper_of([sd.registry, ed.registry, blend], TIMEOUT, GRACE, DISCONNECT, clock, metrics)
    clock.advance(span)
    assert reaper.reap_once() == [] and m.registry.tracked_instance_count() == 1
    clock.advance(0.25)
    assert reaper.reap_once() == [7]
    assert blend.seen() == [7] and m.registry.tracked_instance_count() == 0
    assert reaped_count(metrics, window) == 1  # counted under the window that reaped it


def test_disconnect_grace_zero_leaves_disconnected_entries_to_the_windows(
    clock: FakeClock, modules: Any, caches: list[torch.Tensor]
) -> None:
    sd, _ = modules(clock)
    register(sd, 7, caches, conn_fd=20)
    sd.registry.touch_instance(7)
    sd.registry.mark_connection_closed(20, clock())
    reaper = reaper_of([sd.registry], TIMEOUT, GRACE, 0.0, clock)
    clock.advance(TIMEOUT)
    assert reaper.reap_once() == []
    clock.advance(0.25)
    assert reaper.reap_once() == [7]


@pytest.mark.parametrize("phase", [0.0, 0.01, 7.5, 15.0, 29.99])
def test_a_dead_worker_goes_between_timeout_and_one_and_a_quarter_timeout(
    clock: FakeClock, modules: Any, caches: list[torch.Tensor], phase: float
) -> None:
    sd, _ = modules(clock)
    register(sd, 7, caches)
    sd.registry.touch_instance(7)  # its last signal, at T0
    reaper = reaper_of([sd.registry], TIMEOUT, GRACE, 0.0, clock)
    assert reaper.interval_s == TIMEOUT / 4
    clock.advance(phase)  # the reaper's cycles run every interval from an arbitrary phase
    while not reaper.reap_once():
        clock.advance(reaper.interval_s)
        assert clock() - T0 <= 2 * TIMEOUT, "never reaped"
    assert TIMEOUT < clock() - T0 <= 1.25 * TIMEOUT


def test_a_failing_drop_still_reaches_the_other_targets(
    clock: FakeClock, modules: Any, caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(InstanceLivenessTarget):
        def drop_instance_state(self, instance_id: int) -> None:
            raise RuntimeError("blend state is corrupt")

    sd, _ = modules(clock)
    blend = BlendLike([7])
    register(sd, 7, caches)
    sd.registry.touch_instance(7)
    clock.advance(TIMEOUT + 1)
    reaper = reaper_of([Broken(), sd.registry, blend], TIMEOUT, GRACE, 0.0, clock)
    with caplog.at_level(logging.ERROR, "dataplane.liveness.release"):
        assert reaper.reap_once() == [7]
    assert blend.seen() == [7]
    assert "drop_instance_state(7) failed" in caplog.text


def test_a_failing_target_does_not_keep_the_others_from_being_reaped(
    clock: FakeClock, modules: Any, caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(InstanceLivenessTarget):
        def reap_stale_instances(self, timeout_s: float, grace_s: float) -> list[Reaped]:
            raise RuntimeError("this target cannot reap")

    sd, ed = modules(clock)
    blend = BlendLike([7, 8])
    register(sd, 7, caches)
    register(ed, 8, caches)
    sd.registry.touch_instance(7)
    ed.registry.touch_instance(8)
    clock.advance(TIMEOUT + 1)
    reaper = reaper_of([Broken(), sd.registry, ed.registry, blend], TIMEOUT, GRACE, 0.0, clock)
    with caplog.at_level(logging.ERROR, "dataplane.liveness.reaper"):
        assert sorted(reaper.reap_once()) == [7, 8]  # every cycle asks every target
    assert sd.registry.tracked_instance_count() == ed.registry.tracked_instance_count() == 0
    assert blend.state == {}
    assert "cannot reap" in caplog.text


def test_what_a_reap_popped_is_released_even_when_the_next_reap_of_that_target_fails(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    released: list[tuple[int, str]] = []

    class DisconnectScanFails(LivenessRegistry[Entry]):
        def reap_disconnected_instances(self, disconnect_grace_s: float) -> list[Reaped]:
            raise RuntimeError("disconnect scan failed")

    flaky = DisconnectScanFails("flaky", lambda e, why: released.append((e.instance_id, why)), clock)
    info = InstanceInfo("server_driven", "shm", "m", 1, 0, 1, 2, "bfloat16")
    flaky.put(Entry(7, clock(), clock(), b"", info, has_liveness_signal=True), "test")
    blend = BlendLike([7])
    clock.advance(TIMEOUT + 1)
    metrics = DataPlaneMetrics()
    reaper = reaper_of([flaky, blend], TIMEOUT, GRACE, DISCONNECT, clock, metrics)
    with caplog.at_level(logging.ERROR, "dataplane.liveness.reaper"):
        assert reaper.reap_once() == [7]  # the stale reap popped it: it is finished
    assert flaky.tracked_instance_count() == 0 and released == [(7, "reap")]
    assert blend.seen() == [7]  # fanned out ...
    assert reaper.releaser.reaped_total == 1 and reaped_count(metrics, "timeout") == 1  # ... counted
    assert "disconnect scan failed" in caplog.text


def test_a_reaper_needs_a_positive_timeout() -> None:
    with pytest.raises(ValueError, match="positive reap timeout"):
        reaper_of([], 0.0, 0.0, 0.0)


# ---------------------------------------------------------------------------- the thread


def test_reaper_thread_reaps_and_fans_out(modules: Any, caches: list[torch.Tensor]) -> None:
    timeout = 0.4
    sd, ed = modules(time.monotonic)
    blend = BlendLike([1, 2])
    register(sd, 1, caches)
    register(ed, 2, caches)
    sd.registry.touch_instance(1)
    ed.registry.touch_instance(2)
    metrics = DataPlaneMetrics()
    reaper = reaper_of([sd.registry, ed.registry, blend], timeout, timeout, 0.0, metrics=metrics)
    assert reaper.interval_s == pytest.approx(timeout / 4)
    before = len(reaper_threads())
    reaper.start()
    try:
        assert reaper.is_alive() and len(reaper_threads()) == before + 1
        wait_until(lambda: sorted(blend.seen()) == [1, 2], 5, what="the reaper fan-out")
        # both reaped as silent past the timeout (the registries' own clock decided: not before)
        assert reaped_count(metrics, "timeout") == 2 and reaper.releaser.reaped_total == 2
        assert sd.registry.tracked_instance_count() == ed.registry.tracked_instance_count() == 0
        assert blend.state == {}
    finally:
        reaper.stop()
        assert reaper.join(5)
    assert not reaper.is_alive() and len(reaper_threads()) == before


def test_reaper_thread_wakes_for_a_disconnect_long_before_its_interval(
    modules: Any, caches: list[torch.Tensor]
) -> None:
    sd, _ = modules(time.monotonic)
    blend = BlendLike([7])
    register(sd, 7, caches, conn_fd=20)
    sd.registry.touch_instance(7)
    metrics = DataPlaneMetrics()
    reaper = reaper_of([sd.registry, blend], 40.0, 40.0, 0.3, metrics=metrics)  # cycles every 10 s
    wakes: list[tuple[float | None, bool]] = []  # each wait of the thread: (its timeout, kicked)
    reaps: list[tuple[int, list[int]]] = []  # each cycle: (the wakes before it, what it reaped)

    class Kick(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            kicked = super().wait(timeout)
            wakes.append((timeout, kicked))
            return kicked

    reap_once = reaper.reap_once

    def spied_reap_once() -> list[int]:
        ids = reap_once()
        reaps.append((len(wakes), ids))
        return ids

    reaper._kick = Kick()
    reaper.reap_once = spied_reap_once  # type: ignore[method-assign]
    reaper.start()
    try:
        now = time.monotonic()
        assert sd.registry.mark_connection_closed(20, now) == 1
        reaper.note_disconnect(now)
        wait_until(lambda: blend.seen() == [7], 5, what="the disconnect reap")
        # after the grace: the registry's clock said so (reason "disconnect")
        assert reaped_count(metrics, "disconnect") == 1
        # and well before the 10 s cycle: the cycle that reaped it was woken by the disconnect
        # (a kick, or a wait cut to the grace's deadline), never by a whole interval running out
        (woken_by,) = [wakes[n - 1] for n, ids in reaps if ids == [7]]
        timeout, kicked = woken_by
        assert kicked or (timeout is not None and timeout < reaper.interval_s), (woken_by, wakes)
    finally:
        reaper.stop()
        assert reaper.join(5)


def test_reaper_thread_survives_a_failing_cycle(
    modules: Any, caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    class FailsOnce(InstanceLivenessTarget):
        def __init__(self) -> None:
            self.calls = 0

        def reap_stale_instances(self, timeout_s: float, grace_s: float) -> list[Reaped]:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("first cycle fails")
            return []

    sd, _ = modules(time.monotonic)
    blend = BlendLike([7])
    register(sd, 7, caches)
    sd.registry.touch_instance(7)
    reaper = reaper_of([FailsOnce(), sd.registry, blend], 0.4, 0.4, 0.0)
    with caplog.at_level(logging.ERROR, "dataplane.liveness.reaper"):
        reaper.start()
        try:
            wait_until(lambda: blend.seen() == [7], 5, what="a reap after the failed cycle")
        finally:
            reaper.stop()
            assert reaper.join(5)
    assert "reaper: reaping" in caplog.text and "first cycle fails" in caplog.text


def test_a_stuck_release_neither_stops_the_reaper_nor_blocks_pings(
    clock: FakeClock, caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    sd = StuckTransfer(clock, stuck_id=1)
    blend = BlendLike([1, 2])
    register(sd, 1, caches)
    register(sd, 2, caches)
    sd.registry.touch_instance(1)
    clock.advance(10)
    sd.registry.touch_instance(2)  # 1 is stale (window 0.5), 2 is not
    reaper = reaper_of([sd.registry, blend], 0.5, 0.5, 0.0, clock)  # cycles every 0.125 s (real)
    try:
        with caplog.at_level(logging.ERROR, "dataplane.liveness.registry"):
            reaper.start()
            assert sd.entered.wait(5), "the release of 1 never started"
            # a PING while the release hangs: it returns, and the release has not (ordering,
            # not a wall-clock bound: the release cannot return before ``unblock`` is set)
            assert sd.registry.touch_instance(2) is True
            assert not sd.left.is_set()
            wait_until(lambda: blend.seen() == [1], 5, what="the fan-out past the stuck release")
            assert not sd.left.is_set()  # the fan-out went on while the release still hangs
            clock.advance(1.0)  # now 2 goes stale: the same thread must still reap it
            wait_until(lambda: blend.seen() == [1, 2], 5, what="the next reap")
            assert reaper.is_alive()
            assert sd.registry.tracked_instance_count() == 0
        assert "stuck" in caplog.text
    finally:
        sd.unblock.set()
        reaper.stop()
        assert reaper.join(5)
        sd.close()
    wait_until(sd.left.is_set, 5, what="the abandoned release to finish once unblocked")
