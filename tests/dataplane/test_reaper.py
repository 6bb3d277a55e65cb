"""The worker reaper: its pure step on a fake clock, and its thread on a short real interval.

Targets are the real transfer modules holding real shared memory, plus a blend-like target that
overrides only ``drop_instance_state`` (the role the liveness protocol gives per-instance side
state), so the fan-out is observed where it lands.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from dataplane.client import _layout, allocate_kv_caches, free_kv_caches
from dataplane.liveness.registry import LivenessRegistry
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import InstanceLivenessTarget, RequestContext
from dataplane.modules.engine import EngineDrivenTransferModule
from dataplane.modules.management import WorkerReaper
from dataplane.modules.transfer import CacheContext, ServerDrivenTransferModule
from dataplane.storage.l1 import L1Store
from dataplane.wire.messages import MsgType
from dataplane.wire.protocol import PARSERS
from tests.dataplane.fakes import BlendLike
from tests.helpers import FakeClock, wait_until

CHUNK = 16
T0 = 1000.0
TIMEOUT, GRACE, DISCONNECT = 120.0, 3600.0, 10.0
Clock = Callable[[], float]


class StuckTransfer(ServerDrivenTransferModule):
    """Releasing instance ``stuck_id`` blocks until ``unblock`` is set."""

    def __init__(self, clock: Clock, stuck_id: int) -> None:
        super().__init__(L1Store(8 << 20), CHUNK, DataPlaneMetrics(), clock, release_timeout_s=0.2)
        self.stuck_id = stuck_id
        self.entered = threading.Event()
        self.unblock = threading.Event()

    def _release(self, c: CacheContext, why: str) -> None:
        if c.instance_id == self.stuck_id:
            self.entered.set()
            self.unblock.wait(30)
        super()._release(c, why)


@pytest.fixture
def caches() -> Iterator[list[torch.Tensor]]:
    c = allocate_kv_caches(2, 16, 16, 2, 8, torch.bfloat16)
    yield c
    free_kv_caches(c)


@pytest.fixture
def modules() -> Iterator[Callable[[Clock], tuple[ServerDrivenTransferModule, EngineDrivenTransferModule]]]:
    made: list[LivenessRegistry[Any]] = []

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


def register(
    m: LivenessRegistry[Any], instance_id: int, caches: list[torch.Tensor], conn_fd: int = 5
) -> None:
    if isinstance(m, EngineDrivenTransferModule):
        mtype = MsgType.ENGINE_REGISTER
        raw = [instance_id, "m", 1, 0, "bfloat16", 2, 2, 8, 4, os.getpid()]
    else:
        mtype = MsgType.REGISTER_KV_CACHE
        memory, dtype, shape, layers = _layout(caches)
        raw = [instance_id, "m", 1, 0, "server_driven", memory, dtype, shape, os.getpid(), layers]
    assert isinstance(m, ServerDrivenTransferModule | EngineDrivenTransferModule)
    out = m.handlers()[mtype].fn(RequestContext(1, mtype, conn_fd), PARSERS[mtype](raw))
    assert out["created"] is True


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
    sd.touch_instance(1)
    ed.touch_instance(2)
    clock.advance(TIMEOUT + 1)
    sd.touch_instance(3)
    reported: list[list[int]] = []
    reaper = WorkerReaper([sd, ed, blend], TIMEOUT, GRACE, DISCONNECT, clock, on_reaped=reported.append)
    assert sorted(reaper.reap_once()) == [1, 2]
    assert sorted(blend.seen()) == [1, 2] and blend.state == {3: "rope-3"}
    assert reported and sorted(reported[0]) == [1, 2]
    assert sd.tracked_instance_count() == 1 and ed.tracked_instance_count() == 0
    assert ed.strategy_count() == 0
    assert reaper.reap_once() == [] and sorted(blend.seen()) == [1, 2]  # nothing twice
    assert len(reported) == 1


def test_drop_instance_state_for_an_unknown_id_is_a_no_op(clock: FakeClock, modules: Any) -> None:
    sd, ed = modules(clock)
    blend = BlendLike([5])
    for t in (sd, ed, blend, InstanceLivenessTarget()):
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
        m.touch_instance(7)
    if window == "disconnect":
        assert m.mark_connection_closed(20, clock()) == 1
    span = {"timeout": TIMEOUT, "grace": GRACE, "disconnect": DISCONNECT}[window]
    reaper = WorkerReaper([sd, ed, blend], TIMEOUT, GRACE, DISCONNECT, clock)
    clock.advance(span)
    assert reaper.reap_once() == [] and m.tracked_instance_count() == 1
    clock.advance(0.25)
    assert reaper.reap_once() == [7]
    assert blend.seen() == [7] and m.tracked_instance_count() == 0


def test_disconnect_grace_zero_leaves_disconnected_entries_to_the_windows(
    clock: FakeClock, modules: Any, caches: list[torch.Tensor]
) -> None:
    sd, _ = modules(clock)
    register(sd, 7, caches, conn_fd=20)
    sd.touch_instance(7)
    sd.mark_connection_closed(20, clock())
    reaper = WorkerReaper([sd], TIMEOUT, GRACE, 0.0, clock)
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
    sd.touch_instance(7)  # its last signal, at T0
    reaper = WorkerReaper([sd], TIMEOUT, GRACE, 0.0, clock)
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
    sd.touch_instance(7)
    clock.advance(TIMEOUT + 1)
    reaper = WorkerReaper([Broken(), sd, blend], TIMEOUT, GRACE, 0.0, clock)
    with caplog.at_level(logging.ERROR, "dataplane.modules.management"):
        assert reaper.reap_once() == [7]
    assert blend.seen() == [7]
    assert "drop_instance_state(7) failed" in caplog.text


def test_a_failing_target_does_not_keep_the_others_from_being_reaped(
    clock: FakeClock, modules: Any, caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(InstanceLivenessTarget):
        def reap_stale_instances(self, timeout_s: float, grace_s: float) -> list[int]:
            raise RuntimeError("this target cannot reap")

    sd, ed = modules(clock)
    blend = BlendLike([7, 8])
    register(sd, 7, caches)
    register(ed, 8, caches)
    sd.touch_instance(7)
    ed.touch_instance(8)
    clock.advance(TIMEOUT + 1)
    reaper = WorkerReaper([Broken(), sd, ed, blend], TIMEOUT, GRACE, 0.0, clock)
    with caplog.at_level(logging.ERROR, "dataplane.modules.management"):
        assert sorted(reaper.reap_once()) == [7, 8]  # every cycle asks every target
    assert sd.tracked_instance_count() == ed.tracked_instance_count() == 0
    assert blend.state == {}
    assert "cannot reap" in caplog.text


def test_a_reaper_needs_a_positive_timeout() -> None:
    with pytest.raises(ValueError, match="positive reap timeout"):
        WorkerReaper([], 0.0, 0.0, 0.0)


# ---------------------------------------------------------------------------- the thread


def test_reaper_thread_reaps_and_fans_out(modules: Any, caches: list[torch.Tensor]) -> None:
    timeout = 0.4
    sd, ed = modules(time.monotonic)
    blend = BlendLike([1, 2])
    register(sd, 1, caches)
    register(ed, 2, caches)
    sd.touch_instance(1)
    ed.touch_instance(2)
    last = time.monotonic()
    reaper = WorkerReaper([sd, ed, blend], timeout, timeout, 0.0)
    assert reaper.interval_s == pytest.approx(timeout / 4)
    before = len(reaper_threads())
    reaper.start()
    try:
        assert reaper.is_alive() and len(reaper_threads()) == before + 1
        wait_until(lambda: sorted(blend.seen()) == [1, 2], 5, what="the reaper fan-out")
        took = time.monotonic() - last
        assert timeout < took < 5, took
        assert sd.tracked_instance_count() == ed.tracked_instance_count() == 0
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
    sd.touch_instance(7)
    reaper = WorkerReaper([sd, blend], 40.0, 40.0, 0.3)  # cycles every 10 s
    reaper.start()
    try:
        now = time.monotonic()
        assert sd.mark_connection_closed(20, now) == 1
        reaper.note_disconnect(now)
        wait_until(lambda: blend.seen() == [7], 3, what="the disconnect reap")
        took = time.monotonic() - now
        assert 0.3 < took < 3, took
    finally:
        reaper.stop()
        assert reaper.join(5)


def test_reaper_thread_survives_a_failing_cycle(
    modules: Any, caches: list[torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    class FailsOnce(InstanceLivenessTarget):
        def __init__(self) -> None:
            self.calls = 0

        def reap_stale_instances(self, timeout_s: float, grace_s: float) -> list[int]:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("first cycle fails")
            return []

    sd, _ = modules(time.monotonic)
    blend = BlendLike([7])
    register(sd, 7, caches)
    sd.touch_instance(7)
    reaper = WorkerReaper([FailsOnce(), sd, blend], 0.4, 0.4, 0.0)
    with caplog.at_level(logging.ERROR, "dataplane.modules.management"):
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
    sd.touch_instance(1)
    clock.advance(10)
    sd.touch_instance(2)  # 1 is stale (window 0.5), 2 is not
    reaper = WorkerReaper([sd, blend], 0.5, 0.5, 0.0, clock)  # cycles every 0.125 s (real)
    try:
        with caplog.at_level(logging.ERROR, "dataplane.liveness.registry"):
            reaper.start()
            assert sd.entered.wait(5), "the release of 1 never started"
            t0 = time.monotonic()
            assert sd.touch_instance(2) is True  # a PING while the release hangs
            assert time.monotonic() - t0 < 0.1
            wait_until(lambda: blend.seen() == [1], 5, what="the fan-out past the stuck release")
            clock.advance(1.0)  # now 2 goes stale: the same thread must still reap it
            wait_until(lambda: blend.seen() == [1, 2], 5, what="the next reap")
            assert reaper.is_alive()
            assert sd.tracked_instance_count() == 0
        assert "stuck" in caplog.text
    finally:
        sd.unblock.set()
        reaper.stop()
        assert reaper.join(5)
        sd.close()
