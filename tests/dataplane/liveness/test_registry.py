"""The liveness registry behind the server-driven transfer module, on a fake clock.

Every instance maps real shared memory (`allocate_kv_caches`), registered through the module's
own REGISTER handler; the module owns its registry (``module.registry``), and the clock is a
plain mutable object, so every window is crossed exactly. Whether the server maps a segment is
read from /proc/self/maps: the worker side of this process maps it once, a registered context
once more.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from dataplane.liveness.entry import ContextEntry
from dataplane.liveness.release import InstanceReleaser
from dataplane.liveness.target import InstanceLivenessTarget, Reaped
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import RequestContext
from dataplane.modules.server_driven import CacheContext, ServerDrivenTransferModule
from dataplane.storage.l1 import L1Store
from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.errors import NotRegistered
from dataplane.wire.messages import MsgType, Retrieve, Store
from dataplane.wire.replies import Registered
from tests.dataplane.fakes import BlendLike
from tests.dataplane.registration import SECRET, register_message, segment_of
from tests.helpers import FakeClock, wait_until

CHUNK = 16
T0 = 1000.0
TIMEOUT, GRACE = 120.0, 3600.0


class Recording(ServerDrivenTransferModule):
    """The real module; every release its registry runs is also written down."""

    def __init__(self, clock: FakeClock, release_timeout_s: float = 10.0) -> None:
        super().__init__(L1Store(8 << 20), CHUNK, DataPlaneMetrics(), clock, release_timeout_s)
        self.released: list[tuple[int, str]] = []

    def _release(self, c: CacheContext, why: str) -> None:
        self.released.append((c.instance_id, why))
        super()._release(c, why)


class Stuck(Recording):
    """A module whose release of the ids in ``stuck_ids`` blocks until ``unblock`` is set."""

    def __init__(self, clock: FakeClock, stuck_ids: set[int]) -> None:
        super().__init__(clock, release_timeout_s=0.2)
        self.stuck_ids = stuck_ids
        self.entered = threading.Event()
        self.unblock = threading.Event()

    def _release(self, c: CacheContext, why: str) -> None:
        if c.instance_id in self.stuck_ids:
            self.entered.set()
            self.unblock.wait(30)
        super()._release(c, why)


class Broken(InstanceLivenessTarget):
    """A target in the release path whose every release call raises."""

    name = "broken"

    def remove_instances(self, instance_ids: Iterable[int], why: str) -> list[int]:
        raise RuntimeError("side index is gone")

    def drop_instance_state(self, instance_id: int) -> None:
        raise RuntimeError("blend state is corrupt")


Caches = list[torch.Tensor]


@pytest.fixture
def module(clock: FakeClock) -> Iterator[Recording]:
    m = Recording(clock)
    yield m
    m.close()


def register(
    m: ServerDrivenTransferModule, instance_id: int, caches: Caches, conn_fd: int = 5, model: str = "m"
) -> dict[str, Any]:
    fn = m.handlers()[MsgType.REGISTER_KV_CACHE].fn
    out: dict[str, Any] = fn(
        RequestContext(1, MsgType.REGISTER_KV_CACHE, conn_fd), register_message(instance_id, caches, model)
    )
    return out


def transfer(
    m: ServerDrivenTransferModule, mtype: MsgType, instance_id: int, conn_fd: int = -1
) -> dict[str, Any]:
    tokens = np.arange(100, 100 + 2 * CHUNK, dtype=ID_DTYPE)
    record = {MsgType.STORE: Store, MsgType.RETRIEVE: Retrieve}[mtype]
    payload = record(instance_id, SECRET, tokens, np.array([0, 1], dtype=ID_DTYPE))
    out: dict[str, Any] = m.handlers()[mtype].fn(RequestContext(2, mtype, conn_fd), payload)
    return out


def maps_count(name: str) -> int:
    with open("/proc/self/maps") as f:
        return f.read().count(name)


def entry(m: ServerDrivenTransferModule, instance_id: int) -> ContextEntry:
    e = m.registry.context_entry(instance_id)
    assert e is not None, f"instance {instance_id} is not tracked"
    return e


def reaped_count(metrics: DataPlaneMetrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value("kvwarden_instances_reaped_total", {"reason": reason})


# ------------------------------------------------------------------------ registration


def test_register_inserts_an_unlatched_entry(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    caches = make_caches()
    assert register(module, 7, caches, conn_fd=11) == Registered(True, CHUNK)
    e = entry(module, 7)
    assert (e.registered_at, e.last_seen) == (T0, T0)
    assert e.has_liveness_signal is False
    assert (e.conn_fd, e.disconnected) == (11, False)
    assert (e.transfer_mode, e.memory, e.owner_pid, e.num_layers) == ("server_driven", "shm", os.getpid(), 2)
    assert module.registry.tracked_instance_count() == 1
    assert maps_count(segment_of(caches)) == 2  # the server mapped the worker's memory


def test_repeat_register_refreshes_without_rebuilding_or_latching(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    caches = make_caches()
    register(module, 7, caches)
    clock.advance(50)
    assert register(module, 7, caches, conn_fd=12).created is False
    e = entry(module, 7)
    assert (e.registered_at, e.last_seen) == (T0, T0 + 50)  # same context, refreshed
    assert e.has_liveness_signal is False  # REGISTER never latches
    assert e.conn_fd == 12
    assert module.released == []
    assert maps_count(segment_of(caches)) == 2  # nothing mapped again


def test_repeat_register_keeps_a_latched_signal(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    caches = make_caches()
    register(module, 7, caches)
    assert module.registry.touch_instance(7)
    clock.advance(10)
    register(module, 7, caches)
    e = entry(module, 7)
    assert e.has_liveness_signal is True and e.registered_at == T0


def test_register_with_another_layout_replaces_and_releases_the_old_context(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    old, new = make_caches(), make_caches()
    register(module, 7, old)
    clock.advance(5)
    assert register(module, 7, new).created is True
    assert entry(module, 7).registered_at == T0 + 5
    assert module.released == [(7, "re-registered with a new layout")]
    assert maps_count(segment_of(old)) == 1 and maps_count(segment_of(new)) == 2
    assert module.registry.tracked_instance_count() == 1


# -------------------------------------------------------------------- touch and friends


def test_touch_latches_and_refreshes(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    register(module, 7, make_caches(), conn_fd=5)
    clock.advance(30)
    assert module.registry.touch_instance(7, conn_fd=9) is True
    e = entry(module, 7)
    assert (e.last_seen, e.has_liveness_signal, e.conn_fd) == (T0 + 30, True, 9)
    clock.advance(1)
    assert module.registry.touch_instance(7) is True  # conn_fd -1: connection unknown, kept
    assert (entry(module, 7).last_seen, entry(module, 7).conn_fd) == (T0 + 31, 9)


def test_touch_of_an_unknown_id_is_a_no_op(module: Recording) -> None:
    assert module.registry.touch_instance(404, conn_fd=3) is False
    assert module.registry.tracked_instance_count() == 0
    assert module.registry.context_entry(404) is None
    assert module.registry.reap_stale_instances(0, 0) == []


def test_a_request_refreshes_without_latching(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    register(module, 7, make_caches())
    clock.advance(40)
    got = module.registry.touch(7, secret=SECRET)
    assert got.instance_id == 7 and got.last_seen == T0 + 40
    e = entry(module, 7)
    assert (e.last_seen, e.has_liveness_signal) == (T0 + 40, False)
    with pytest.raises(NotRegistered, match="not registered"):
        module.registry.touch(404, secret=SECRET)


def test_snapshot_is_a_copy(module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]) -> None:
    register(module, 7, make_caches())
    register(module, 8, make_caches())
    snap = module.registry.context_entries_snapshot()
    assert sorted(e.instance_id for e in snap) == [7, 8]
    clock.advance(9)
    module.registry.touch_instance(7)
    assert all(e.last_seen == T0 and not e.has_liveness_signal for e in snap)


def test_liveness_rows_are_what_changes_in_snapshot_order(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    for iid in (9, 3, 7):
        register(module, iid, make_caches())
        clock.advance(1)
    module.registry.touch_instance(3)
    rows = module.registry.liveness_rows()
    snap = module.registry.context_entries_snapshot()
    assert rows == [
        (e.instance_id, e.registered_at, e.last_seen, e.has_liveness_signal, e.disconnected) for e in snap
    ]
    assert [r[0] for r in rows] == [9, 3, 7] and rows[1][2:4] == (T0 + 3, True)
    module.registry.touch_instance(9)  # a copy: later PINGs do not show in it
    assert rows[0][2:4] == (T0, False)


# ---------------------------------------------------------------------------- transfers


@pytest.mark.parametrize("mtype", [MsgType.STORE, MsgType.RETRIEVE])
def test_transfer_refreshes_without_latching(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches], mtype: MsgType
) -> None:
    register(module, 7, make_caches())
    clock.advance(60)
    transfer(module, mtype, 7, conn_fd=13)
    e = entry(module, 7)
    assert (e.last_seen, e.has_liveness_signal, e.conn_fd) == (T0 + 60, False, 13)


def test_lookup_resolution_refreshes_without_latching(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    register(module, 7, make_caches())
    clock.advance(60)
    assert module.registry.scope_of(7, conn_fd=14) is not None
    e = entry(module, 7)
    assert (e.last_seen, e.has_liveness_signal, e.conn_fd) == (T0 + 60, False, 14)
    assert module.registry.scope_of(404) is None


@pytest.mark.parametrize("mtype", [MsgType.STORE, MsgType.RETRIEVE])
def test_transfer_for_an_unknown_id_raises_not_registered(module: Recording, mtype: MsgType) -> None:
    with pytest.raises(NotRegistered, match="instance 404 is not registered"):
        transfer(module, mtype, 404)
    assert module.registry.tracked_instance_count() == 0


def test_transfers_keep_a_worker_with_a_starved_heartbeat_alive(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    register(module, 7, make_caches())
    module.registry.touch_instance(7)  # one PING, then only traffic
    for _ in range(30):
        clock.advance(TIMEOUT - 1)
        transfer(module, MsgType.STORE, 7)
        assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == []
    assert entry(module, 7).last_seen == T0 + 30 * (TIMEOUT - 1)


# ------------------------------------------------------------------------------- reaping


def test_two_tier_reap_takes_only_the_stale_pinged_entry_and_releases_it_once(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches], caplog: pytest.LogCaptureFixture
) -> None:
    stale, warming, fresh = make_caches(), make_caches(), make_caches()
    register(module, 1, stale)
    register(module, 2, warming)  # never pings: the registration grace applies
    register(module, 3, fresh)
    module.registry.touch_instance(1)
    clock.advance(TIMEOUT + 1)
    module.registry.touch_instance(3)
    with caplog.at_level(logging.WARNING, "dataplane.liveness.registry"):
        reaped = module.registry.reap_stale_instances(TIMEOUT, GRACE)
    # what a reap listener used to receive: id, reason, silence, whether it ever pinged
    assert reaped == [Reaped(1, "timeout", TIMEOUT + 1, True)]
    assert module.released == [(1, "reap")]
    assert maps_count(segment_of(stale)) == 1  # the server's mapping is gone ...
    assert maps_count(segment_of(warming)) == 2 and maps_count(segment_of(fresh)) == 2
    assert sorted(e.instance_id for e in module.registry.context_entries_snapshot()) == [2, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "reaped instance 1 " in warnings[0] and "silent 121.0s" in warnings[0]
    assert "pinged" in warnings[0] and "never" not in warnings[0]
    # ... and it is released exactly once, however often the reaper runs again
    clock.advance(TIMEOUT + 1)
    module.registry.touch_instance(3)
    assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == []
    assert module.released == [(1, "reap")]


@pytest.mark.parametrize("pinged, window, reason", [(True, TIMEOUT, "timeout"), (False, GRACE, "grace")])
def test_window_boundary_is_strict(
    module: Recording,
    clock: FakeClock,
    make_caches: Callable[[], Caches],
    pinged: bool,
    window: float,
    reason: str,
) -> None:
    register(module, 7, make_caches())
    if pinged:
        module.registry.touch_instance(7)
    clock.advance(window)  # exactly the window: not yet stale
    assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == []
    assert module.registry.tracked_instance_count() == 1
    clock.advance(0.25)  # just over
    assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == [Reaped(7, reason, window + 0.25, pinged)]
    assert module.released == [(7, "reap")]


def test_a_never_pinged_entry_is_not_held_to_the_timeout(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches], caplog: pytest.LogCaptureFixture
) -> None:
    register(module, 7, make_caches())
    clock.advance(GRACE - 1)  # far beyond the timeout, within the grace
    assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == []
    clock.advance(2)
    with caplog.at_level(logging.WARNING, "dataplane.liveness.registry"):
        assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == [Reaped(7, "grace", GRACE + 1, False)]
    assert "never pinged" in caplog.text


def test_a_failing_target_in_the_release_path_does_not_leak_the_reaped_context(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches], caplog: pytest.LogCaptureFixture
) -> None:
    # (was: a failing reap listener; the listener is gone, the release path is what runs after)
    reaped_caches, admin_caches = make_caches(), make_caches()
    register(module, 7, reaped_caches)
    register(module, 8, admin_caches)
    module.registry.touch_instance(7)
    blend = BlendLike([7, 8])
    # the broken target comes first: every call into it raises before the others are reached
    releaser = InstanceReleaser([Broken(), module.registry, blend], module.metrics)
    clock.advance(TIMEOUT + 1)
    module.registry.touch_instance(8)
    reaped = module.registry.reap_stale_instances(TIMEOUT, GRACE)
    assert reaped == [Reaped(7, "timeout", TIMEOUT + 1, True)]
    with caplog.at_level(logging.ERROR, "dataplane.liveness.release"):
        assert releaser.release([7], "timeout", popped_by=module.registry.name) == {7: ("server_driven",)}
        # the admin reap: the registry's own removal runs after the broken target's
        assert releaser.release([8], "admin") == {8: ("server_driven",)}
    assert module.registry.tracked_instance_count() == 0
    # popped from the dict, so nobody else will ever release them: the release path must
    assert module.released == [(7, "reap"), (8, "admin")], "a reaped context was never released"
    assert maps_count(segment_of(reaped_caches)) == 1 and maps_count(segment_of(admin_caches)) == 1
    # the other targets still got the fan-out, and both reaps were counted
    assert blend.seen() == [7, 8] and blend.state == {}
    assert releaser.reaped_total == 2
    assert reaped_count(module.metrics, "timeout") == 1 and reaped_count(module.metrics, "admin") == 1
    assert "broken failed to release 1 instance(s)" in caplog.text
    assert "broken: drop_instance_state(7) failed" in caplog.text
    assert "broken: drop_instance_state(8) failed" in caplog.text


def test_remove_is_the_unregister_cleanup_and_is_idempotent(
    module: Recording, make_caches: Callable[[], Caches]
) -> None:
    caches = make_caches()
    register(module, 7, caches)
    assert module.registry.remove_instances([7], "unregister") == [7]
    assert module.registry.remove_instances([7], "unregister") == []
    assert module.released == [(7, "unregister")]
    assert module.registry.tracked_instance_count() == 0 and maps_count(segment_of(caches)) == 1
    with pytest.raises(NotRegistered):
        transfer(module, MsgType.STORE, 7)
    assert module.registry.touch_instance(7) is False


def test_reap_during_a_transfer_defers_the_release_to_its_end(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    caches = make_caches()
    register(module, 7, caches)
    module.registry.touch_instance(7)
    with module.registry.use(7):  # a transfer holds the context
        clock.advance(TIMEOUT + 1)
        assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == [
            Reaped(7, "timeout", TIMEOUT + 1, True)
        ]
        assert module.registry.tracked_instance_count() == 0
        assert module.released == []  # its memory is still being copied
        assert maps_count(segment_of(caches)) == 2
    assert module.released == [(7, "deferred")]
    assert maps_count(segment_of(caches)) == 1


def test_close_releases_every_entry(clock: FakeClock, make_caches: Callable[[], Caches]) -> None:
    m = Recording(clock)
    a, b = make_caches(), make_caches()
    register(m, 1, a)
    register(m, 2, b)
    m.close()
    assert sorted(m.released) == [(1, "shutdown"), (2, "shutdown")]
    assert maps_count(segment_of(a)) == 1 and maps_count(segment_of(b)) == 1


# ----------------------------------------------------------------------- disconnection


def test_disconnected_instance_is_reaped_just_after_the_grace(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    register(module, 1, make_caches(), conn_fd=20)
    register(module, 2, make_caches(), conn_fd=21)
    module.registry.touch_instance(1)
    module.registry.touch_instance(2)
    assert module.registry.mark_connection_closed(20, clock()) == 1
    assert entry(module, 1).disconnected and not entry(module, 2).disconnected
    clock.advance(10.0)  # exactly the grace: not yet
    assert module.registry.reap_disconnected_instances(10.0) == []
    assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == []  # the windows do not care
    clock.advance(0.25)
    assert module.registry.reap_disconnected_instances(10.0) == [Reaped(1, "disconnect", 10.25, True)]
    assert module.released == [(1, "reap")]
    assert module.registry.reap_disconnected_instances(10.0) == []
    assert module.registry.tracked_instance_count() == 1


def test_disconnect_counts_from_the_first_close(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches]
) -> None:
    register(module, 1, make_caches(), conn_fd=20)
    module.registry.mark_connection_closed(20, clock())
    clock.advance(6)
    assert module.registry.mark_connection_closed(20, clock()) == 0  # already flagged
    clock.advance(4.25)
    assert module.registry.reap_disconnected_instances(10.0) == [Reaped(1, "disconnect", 10.25, False)]


@pytest.mark.parametrize("how", ["ping", "register", "store", "lookup"])
def test_instance_speaking_over_a_new_connection_is_not_reaped(
    module: Recording, clock: FakeClock, make_caches: Callable[[], Caches], how: str
) -> None:
    caches = make_caches()
    register(module, 1, caches, conn_fd=20)
    module.registry.mark_connection_closed(20, clock())
    clock.advance(3)
    if how == "ping":
        assert module.registry.touch_instance(1, conn_fd=31)
    elif how == "register":
        register(module, 1, caches, conn_fd=31)
    elif how == "store":
        transfer(module, MsgType.STORE, 1, conn_fd=31)
    else:
        assert module.registry.scope_of(1, conn_fd=31) is not None
    e = entry(module, 1)
    assert (e.disconnected, e.conn_fd) == (False, 31)
    clock.advance(60)
    assert module.registry.reap_disconnected_instances(10.0) == []
    assert module.registry.tracked_instance_count() == 1
    assert module.registry.mark_connection_closed(20, clock()) == 0  # the old fd no longer names it


# ------------------------------------------------------------------------ stuck release


def test_stuck_release_is_bounded_and_blocks_no_touch(
    clock: FakeClock, make_caches: Callable[[], Caches], caplog: pytest.LogCaptureFixture
) -> None:
    m = Stuck(clock, stuck_ids={1})
    try:
        register(m, 1, make_caches())
        register(m, 2, make_caches())
        m.registry.touch_instance(1)
        clock.advance(TIMEOUT + 1)
        m.registry.touch_instance(2)
        result: list[list[Reaped]] = []
        reaper = threading.Thread(
            target=lambda: result.append(m.registry.reap_stale_instances(TIMEOUT, GRACE))
        )
        with caplog.at_level(logging.ERROR, "dataplane.liveness.registry"):
            reaper.start()
            assert m.entered.wait(5), "release never started"
            # the release is stuck: PINGs (touch) and lookups of other instances go on
            assert m.registry.touch_instance(2) is True
            assert m.registry.scope_of(2) is not None
            assert m.registry.touch_instance(1) is False  # it is already gone from the dict
            reaper.join(20)  # a guard: the stuck call holds until unblock is set (or 30 s)
        # the reap returned while its release was still stuck (bounded by release_timeout_s, not
        # by the stuck call): nothing was released yet, and nothing had unblocked it
        assert not reaper.is_alive() and result == [[Reaped(1, "timeout", TIMEOUT + 1, True)]]
        assert not m.unblock.is_set() and m.released == []  # still stuck, abandoned
        assert "stuck" in caplog.text
        # the next cycle works: another instance is reaped and released normally
        clock.advance(TIMEOUT + 1)
        assert m.registry.reap_stale_instances(TIMEOUT, GRACE) == [Reaped(2, "timeout", TIMEOUT + 1, True)]
        assert m.released == [(2, "reap")]
    finally:
        m.unblock.set()
        m.close()
    # once unblocked, the abandoned release finishes
    wait_until(lambda: (1, "reap") in m.released, 5, what="the abandoned release to finish")
