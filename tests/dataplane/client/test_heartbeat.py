"""The heartbeat's state machine, driven one beat at a time on an injected clock.

Its seams are the callables it is built with (one PING, one re-register, "are we registered");
here they are plain functions, so every edge of the machine is crossed exactly. The real
thing, with real sockets and servers, is in test_client_heartbeat.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from dataplane.client.heartbeat import Heartbeat
from dataplane.wire.errors import RequestTimeout
from dataplane.wire.replies import PingReply
from tests.helpers import FakeClock, wait_until


class Peer:
    """What the heartbeat talks to: a scripted PING reply and a re-register that may fail."""

    def __init__(self, token: int = 1) -> None:
        self.reply: PingReply | Exception = PingReply(token, True)
        self.recover_ok = True
        self.recovers = 0
        self.registered = True

    def ping(self) -> dict[str, Any]:
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply

    def recover(self) -> bool:
        self.recovers += 1
        return self.recover_ok


@pytest.fixture
def peer() -> Peer:
    return Peer()


def make(peer: Peer, clock: FakeClock, changes: list[bool] | None = None) -> Heartbeat:
    hb = Heartbeat(
        peer.ping,
        peer.recover,
        lambda: peer.registered,
        10.0,
        None if changes is None else changes.append,
        clock,
    )
    hb.adopt(1)
    return hb


def test_starts_healthy_and_a_good_ping_changes_nothing(peer: Peer, clock: FakeClock) -> None:
    changes: list[bool] = []
    hb = make(peer, clock, changes)
    assert hb.healthy.is_set()
    hb.beat()
    assert hb.healthy.is_set() and peer.recovers == 0 and changes == []


def test_a_failed_ping_is_unhealthy_and_the_next_good_one_recovers_first(
    peer: Peer, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    changes: list[bool] = []
    hb = make(peer, clock, changes)
    peer.reply = RequestTimeout("PING: no reply within 10s")
    hb.beat()
    assert not hb.healthy.is_set() and changes == [False] and peer.recovers == 0
    hb.beat()  # still failing: no second edge
    assert changes == [False]
    clock.advance(42.5)
    peer.reply = PingReply(1, True)
    with caplog.at_level(logging.INFO, "dataplane.client.heartbeat"):
        hb.beat()
    assert peer.recovers == 1 and hb.healthy.is_set() and changes == [False, True]
    assert "healthy again after 42.5s" in caplog.text  # counted from the first failure


def test_a_failed_recovery_stays_unhealthy_and_is_retried(peer: Peer, clock: FakeClock) -> None:
    hb = make(peer, clock)
    peer.reply = RequestTimeout("down")
    hb.beat()
    peer.reply = PingReply(1, True)
    peer.recover_ok = False
    hb.beat()
    assert not hb.healthy.is_set() and peer.recovers == 1
    peer.recover_ok = True
    hb.beat()
    assert hb.healthy.is_set() and peer.recovers == 2


def test_a_new_boot_token_recovers_at_once_and_is_adopted(peer: Peer, clock: FakeClock) -> None:
    hb = make(peer, clock)
    peer.reply = PingReply(2, True)
    hb.beat()  # this PING succeeded: only the token tells the server restarted
    assert peer.recovers == 1 and hb.boot_token == 2 and hb.healthy.is_set()
    hb.beat()
    assert peer.recovers == 1  # adopted: not noticed twice


def test_a_failed_recovery_after_a_restart_keeps_the_old_token(peer: Peer, clock: FakeClock) -> None:
    hb = make(peer, clock)
    peer.reply = PingReply(2, True)
    peer.recover_ok = False
    hb.beat()
    assert hb.boot_token == 1 and not hb.healthy.is_set()  # so the next beat tries again
    peer.recover_ok = True
    hb.beat()
    assert hb.boot_token == 2 and hb.healthy.is_set() and peer.recovers == 2


def test_untracked_recovers_only_when_registered(peer: Peer, clock: FakeClock) -> None:
    hb = make(peer, clock)
    peer.reply = PingReply(1, False)
    peer.registered = False
    hb.beat()
    assert peer.recovers == 0  # nothing to re-register yet
    peer.registered = True
    hb.beat()
    assert peer.recovers == 1 and hb.healthy.is_set()


def test_after_stop_nothing_is_recovered_and_health_is_left_alone(peer: Peer, clock: FakeClock) -> None:
    changes: list[bool] = []
    hb = make(peer, clock, changes)
    hb.stop()
    peer.reply = RequestTimeout("closing")
    hb.beat()
    assert hb.healthy.is_set() and changes == []  # a failing PING while closing is no outage
    peer.reply = PingReply(2, False)
    hb.beat()
    assert peer.recovers == 0 and hb.boot_token == 1
    assert hb.recover(2) is False and peer.recovers == 0  # no ghost registration


def test_recover_now_without_marking_an_outage(peer: Peer, clock: FakeClock) -> None:
    hb = make(peer, clock)
    peer.recover_ok = False
    assert hb.recover(1, failure_is_outage=False) is False
    assert hb.healthy.is_set()  # a failed re-register on a miss does not mark an outage
    assert hb.recover(1) is False
    assert not hb.healthy.is_set()


def test_the_thread_paces_beats_and_stops(peer: Peer, clock: FakeClock) -> None:
    beats: list[int] = []

    def ping() -> dict[str, Any]:
        beats.append(1)
        return PingReply(1, True)

    hb = Heartbeat(ping, peer.recover, lambda: True, 0.01, None, clock)
    hb.start()
    wait_until(lambda: len(beats) >= 3, 10, what="three beats")
    hb.stop()
    assert hb.join(10.0)
    n = len(beats)
    assert hb.join(0.0) and len(beats) == n  # no beat after the join
