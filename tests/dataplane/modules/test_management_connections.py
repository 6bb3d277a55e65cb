"""The management module on a running server, over real sockets: PING answered while a
registration is slow, and disconnect detection (a closed connection's instance reaped after the
disconnect grace, unless it speaks over a new connection; nothing flagged without a grace)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import RequestContext
from dataplane.modules.server_driven import ServerDrivenTransferModule
from dataplane.storage.l1 import L1Store
from dataplane.wire.messages import Register
from dataplane.wire.protocol import decode_reply, encode_message
from tests.dataplane.modules.management_support import CHUNK, Caches, Running, call, ping_of, sample
from tests.dataplane.registration import register_message
from tests.helpers import FakeClock, wait_until

# ----------------------------------------------------------------------- the running server


def test_ping_is_answered_while_a_registration_is_slow(
    running: Callable[..., Running], make_caches: Callable[[], Caches]
) -> None:
    gate, entered, left = threading.Event(), threading.Event(), threading.Event()

    class SlowRegister(ServerDrivenTransferModule):
        def _register(self, rctx: RequestContext, reg: Register) -> dict[str, Any]:
            entered.set()
            gate.wait(30)
            left.set()
            return super()._register(rctx, reg)

    r = running(SlowRegister(L1Store(8 << 20), CHUNK, DataPlaneMetrics()))
    slow, pinger = r.dealer(), r.dealer()
    try:
        slow.send(encode_message(1, register_message(7, make_caches())))
        assert entered.wait(10)
        assert call(pinger, 2, ping_of(7))["tracked"] is False
        assert call(pinger, 3, ping_of(None))["boot_token"] == r.server.boot_token
        # Ordering, not a wall-clock bound (a shared 2-core CI machine can stall any thread
        # past a bound worth asserting): both PINGs were answered while the registration was
        # still held inside its handler, its reply not yet sent.
        assert not left.is_set()
        assert not slow.poll(0, zmq.POLLIN)
    finally:
        gate.set()
    assert slow.poll(10_000, zmq.POLLIN)
    assert decode_reply(slow.recv()).body["created"] is True
    assert call(pinger, 4, ping_of(7))["tracked"] is True


def test_closed_connection_gets_its_instance_reaped_after_the_grace(
    running: Callable[..., Running], make_caches: Callable[[], Caches], monkeypatch: pytest.MonkeyPatch
) -> None:
    grace = 0.5
    clock = FakeClock()  # the liveness clock: it moves only when the test says
    r = running(reap_timeout_s=60.0, registration_grace_s=60.0, disconnect_grace_s=grace, clock=clock)
    reaper = r.management.reaper
    assert reaper is not None and reaper.interval_s == 15.0
    waits: list[float] = []  # each wait the reaper thread schedules, in seconds
    next_wait = reaper._next_wait

    def spied() -> float:
        w = next_wait()
        waits.append(w)
        return w

    monkeypatch.setattr(reaper, "_next_wait", spied)
    sock = r.dealer()
    call(sock, 1, register_message(7, make_caches()))
    call(sock, 2, ping_of(7))
    sock.close(linger=0)
    # the reaper flagged the close and set its next wake at the grace's deadline, far below its
    # 15 s step (the clock stands still: that wait is the grace itself, plus its 0.05 s margin)
    wait_until(lambda: any(w <= grace + 0.05 for w in waits), 10, what="a wake at the grace's deadline")
    assert r.blend.seen() == [] and r.transfer.registry.context_entry(7) is not None  # never before
    clock.advance(2 * grace)
    wait_until(lambda: r.blend.seen() == [7], 10, what="the disconnect reap")
    assert r.transfer.registry.context_entry(7) is None
    assert sample(r.metrics, "kvwarden_instances_reaped_total", reason="disconnect") == 1
    assert r.management.releaser.reaped_total == 1


def test_instance_that_speaks_over_a_new_connection_is_not_reaped(
    running: Callable[..., Running], make_caches: Callable[[], Caches]
) -> None:
    grace = 0.5
    r = running(reap_timeout_s=60.0, registration_grace_s=60.0, disconnect_grace_s=grace)
    old, new = r.dealer(), r.dealer()
    call(old, 1, register_message(7, make_caches()))
    call(new, 2, ping_of(None))  # the new connection is up before the old one goes
    call(old, 3, ping_of(7))
    old.close(linger=0)
    wait_until(
        lambda: (e := r.transfer.registry.context_entry(7)) is not None and e.disconnected,
        3,
        what="the close to be noticed",
    )
    assert call(new, 4, ping_of(7))["tracked"] is True
    entry = r.transfer.registry.context_entry(7)
    assert entry is not None and not entry.disconnected
    deadline = time.monotonic() + 3 * grace
    tick = threading.Event()
    while time.monotonic() < deadline:  # well past the grace: still there
        assert r.transfer.registry.context_entry(7) is not None
        tick.wait(0.05)
    assert r.blend.seen() == [] and r.management.releaser.reaped_total == 0


def test_without_a_disconnect_grace_closing_flags_nothing(
    running: Callable[..., Running], make_caches: Callable[[], Caches]
) -> None:
    r = running(reap_timeout_s=60.0, registration_grace_s=60.0, disconnect_grace_s=0.0)
    sock = r.dealer()
    call(sock, 1, register_message(7, make_caches()))
    sock.close(linger=0)
    wait_until(lambda: r.closes, 5, what="the loop to deliver the close")
    deadline = time.monotonic() + 1.0
    tick = threading.Event()
    while time.monotonic() < deadline:
        e = r.transfer.registry.context_entry(7)
        assert e is not None and not e.disconnected
        tick.wait(0.05)
