"""Liveness of the engine-driven transfer module: a context and its chunk pool live and die as one.

The pool is a real shared-memory segment the module creates and owns; whether it still exists
is read from the shared-memory directory. The clock is a fake one moved by hand.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from dataplane.liveness.target import Reaped
from dataplane.memory import shm
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import RequestContext
from dataplane.modules.engine_pool import EngineContext, EngineDrivenTransferModule
from dataplane.storage.l1 import L1Store
from dataplane.wire.checks import ids_to_bytes
from dataplane.wire.errors import NotRegistered
from dataplane.wire.messages import MsgType
from dataplane.wire.table import PARSERS
from tests.dataplane.registration import SECRET, engine_register_message
from tests.helpers import FakeClock

CHUNK = 16
T0 = 1000.0
TIMEOUT, GRACE = 120.0, 3600.0
SLOT_BYTES = 2 * 2 * CHUNK * 2 * 8 * 2  # layers * K/V * tokens * heads * head_dim * bf16


class Recording(EngineDrivenTransferModule):
    """The real module; every release it runs (through its registry) is also written down."""

    def __init__(self, clock: Any) -> None:
        super().__init__(L1Store(8 << 20), CHUNK, DataPlaneMetrics(), clock)
        self.released: list[tuple[int, str]] = []

    def _release(self, c: EngineContext, why: str) -> None:
        self.released.append((c.instance_id, why))
        super()._release(c, why)


@pytest.fixture
def module(clock: FakeClock) -> Iterator[Recording]:
    m = Recording(clock)
    yield m
    m.close()


def register(
    m: EngineDrivenTransferModule, instance_id: int, conn_fd: int = 5, pool_chunks: int = 4
) -> dict[str, Any]:
    msg = engine_register_message(instance_id, pool_chunks)
    out: dict[str, Any] = m.handlers()[MsgType.ENGINE_REGISTER].fn(
        RequestContext(1, MsgType.ENGINE_REGISTER, conn_fd), msg
    )
    return out


def transfer(
    m: EngineDrivenTransferModule, mtype: MsgType, instance_id: int, conn_fd: int = -1
) -> dict[str, Any]:
    tokens = ids_to_bytes(list(range(200, 200 + 2 * CHUNK)))
    blocks = [None] if mtype is MsgType.ENGINE_STORE else []  # (ENGINE_STORE ends with `blocks`)
    payload = PARSERS[mtype]([instance_id, SECRET, tokens, 0, 2, None, *blocks])
    out: dict[str, Any] = m.handlers()[mtype].fn(RequestContext(2, mtype, conn_fd), payload)
    return out


def pool_exists(name: str) -> bool:
    return (shm.SHM_DIR / name).exists()


def entry(m: EngineDrivenTransferModule, instance_id: int) -> Any:
    e = m.registry.context_entry(instance_id)
    assert e is not None, f"instance {instance_id} is not tracked"
    return e


def test_register_inserts_an_unlatched_context_with_its_pool(module: Recording) -> None:
    r = register(module, 7, conn_fd=11)
    assert r.created is True and (r.slots, r.slot_bytes) == (4, SLOT_BYTES)
    assert pool_exists(r.segment) and r.segment.startswith(f"kvwarden-{os.getpid()}-")
    e = entry(module, 7)
    assert (e.registered_at, e.last_seen, e.has_liveness_signal, e.conn_fd) == (T0, T0, False, 11)
    assert e.transfer_mode == "engine_driven"
    assert module.registry.tracked_instance_count() == 1


def test_repeat_register_refreshes_without_rebuilding_or_latching(
    module: Recording, clock: FakeClock
) -> None:
    first = register(module, 7)
    clock.advance(50)
    again = register(module, 7, conn_fd=12)
    assert again.created is False and again.segment == first.segment
    e = entry(module, 7)
    assert (e.registered_at, e.last_seen, e.has_liveness_signal, e.conn_fd) == (T0, T0 + 50, False, 12)
    assert module.released == [] and module.registry.tracked_instance_count() == 1


def test_register_with_another_pool_replaces_context_and_pool(module: Recording) -> None:
    old = register(module, 7, pool_chunks=4)
    new = register(module, 7, pool_chunks=8)
    assert new.created is True and new.segment != old.segment
    assert not pool_exists(old.segment) and pool_exists(new.segment)
    assert module.released == [(7, "re-registered")]
    assert module.registry.tracked_instance_count() == 1


def test_a_ping_latches_a_request_does_not(module: Recording, clock: FakeClock) -> None:
    register(module, 7)
    clock.advance(20)
    assert module.registry.touch(7, secret=SECRET).last_seen == T0 + 20
    assert entry(module, 7).has_liveness_signal is False
    clock.advance(20)
    assert module.registry.touch_instance(7, conn_fd=9) is True
    e = entry(module, 7)
    assert (e.last_seen, e.has_liveness_signal, e.conn_fd) == (T0 + 40, True, 9)
    assert module.registry.touch_instance(404) is False and module.registry.tracked_instance_count() == 1


def test_reap_pops_context_and_pool_together_and_spares_a_warming_entry(
    module: Recording, clock: FakeClock
) -> None:
    dead = register(module, 1).segment
    warming = register(module, 2).segment  # registered, never pinged
    module.registry.touch_instance(1)
    clock.advance(TIMEOUT + 1)
    assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == [Reaped(1, "timeout", TIMEOUT + 1, True)]
    assert module.released == [(1, "reap")]
    assert not pool_exists(dead)  # the server's pool segment is unlinked
    assert module.registry.context_entry(1) is None
    assert module.registry.tracked_instance_count() == 1
    assert pool_exists(warming) and entry(module, 2).has_liveness_signal is False


@pytest.mark.parametrize("pinged, window, reason", [(True, TIMEOUT, "timeout"), (False, GRACE, "grace")])
def test_window_boundary_is_strict(
    module: Recording, clock: FakeClock, pinged: bool, window: float, reason: str
) -> None:
    pool = register(module, 7).segment
    if pinged:
        module.registry.touch_instance(7)
    clock.advance(window)
    assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == []
    assert pool_exists(pool) and module.registry.tracked_instance_count() == 1
    clock.advance(0.25)
    assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == [Reaped(7, reason, window + 0.25, pinged)]
    assert not pool_exists(pool)
    assert module.registry.tracked_instance_count() == 0


def test_disconnect_boundary_and_reconnect(module: Recording, clock: FakeClock) -> None:
    gone = register(module, 1, conn_fd=20).segment
    back = register(module, 2, conn_fd=21).segment
    assert module.registry.mark_connection_closed(20, clock()) == 1
    assert module.registry.mark_connection_closed(21, clock()) == 1
    clock.advance(1)
    assert module.registry.touch_instance(2, conn_fd=33)  # speaks again over a new connection
    clock.advance(9)  # 10 s since the close: exactly the grace
    assert module.registry.reap_disconnected_instances(10.0) == []
    clock.advance(0.25)
    assert module.registry.reap_disconnected_instances(10.0) == [Reaped(1, "disconnect", 10.25, False)]
    assert not pool_exists(gone) and pool_exists(back)
    assert [e.instance_id for e in module.registry.context_entries_snapshot()] == [2]


@pytest.mark.parametrize("mtype", [MsgType.ENGINE_STORE, MsgType.ENGINE_RETRIEVE])
def test_transfer_refreshes_without_latching(module: Recording, clock: FakeClock, mtype: MsgType) -> None:
    register(module, 7)
    clock.advance(70)
    transfer(module, mtype, 7, conn_fd=15)
    e = entry(module, 7)
    assert (e.last_seen, e.has_liveness_signal, e.conn_fd) == (T0 + 70, False, 15)


@pytest.mark.parametrize("mtype", [MsgType.ENGINE_STORE, MsgType.ENGINE_RETRIEVE])
def test_transfer_of_an_unknown_id_raises_not_registered(module: Recording, mtype: MsgType) -> None:
    with pytest.raises(NotRegistered, match="instance 404 is not registered"):
        transfer(module, mtype, 404)


def test_remove_is_idempotent_and_unlinks_the_pool(module: Recording) -> None:
    pool = register(module, 7).segment
    assert module.registry.remove_instances([7], "unregister") == [7]
    assert module.registry.remove_instances([7], "unregister") == []
    assert module.released == [(7, "unregister")] and not pool_exists(pool)
    assert module.registry.tracked_instance_count() == 0


def test_reap_during_a_transfer_keeps_the_pool_until_it_ends(module: Recording, clock: FakeClock) -> None:
    pool = register(module, 7).segment
    module.registry.touch_instance(7)
    with module.registry.use(7):
        clock.advance(TIMEOUT + 1)
        assert module.registry.reap_stale_instances(TIMEOUT, GRACE) == [
            Reaped(7, "timeout", TIMEOUT + 1, True)
        ]
        assert module.registry.tracked_instance_count() == 0 and pool_exists(pool)
    assert module.released == [(7, "deferred")] and not pool_exists(pool)


def test_close_unlinks_every_pool(clock: FakeClock) -> None:
    m = Recording(clock)
    pools = [register(m, i).segment for i in (1, 2, 3)]
    m.close()
    assert not any(pool_exists(p) for p in pools)
    assert m.registry.tracked_instance_count() == 0


def test_reregister_racing_the_reaper_leaks_no_pool() -> None:
    ticks = itertools.count(start=1)  # every reading is 1 s later: everything is always stale
    m = Recording(lambda: float(next(ticks)))
    pools: list[str] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def registrar() -> None:
        deadline = time.monotonic() + 20
        try:  # until the reaper has raced it into 20 rebuilds
            while len(set(pools)) < 20 and time.monotonic() < deadline:
                pools.append(register(m, 1).segment)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)
        finally:
            stop.set()

    def reaper() -> None:
        while not stop.is_set():
            m.registry.reap_stale_instances(0.5, 0.5)

    threads = [threading.Thread(target=registrar), threading.Thread(target=reaper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert m.registry.tracked_instance_count() <= 1
    live = {e.instance_id for e in m.registry.context_entries_snapshot()}
    m.close()
    assert live <= {1}
    assert len(set(pools)) >= 20  # the race really rebuilt
    assert [p for p in set(pools) if pool_exists(p)] == []
