"""`dataplane.wire.frames`: the loop's reads and writes on a real ROUTER socket."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from dataplane.wire.frames import has_message, recv_message, send_message


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 1)
    dealer.setsockopt(zmq.RCVHWM, 1)
    router.bind("inproc://frames")
    dealer.connect("inproc://frames")
    try:
        yield router, dealer
    finally:
        router.close()
        dealer.close()
        ctx.term()


def _wait_readable(sock: zmq.Socket[Any]) -> None:
    assert sock.poll(5000, zmq.POLLIN), "nothing arrived in 5 s"


def test_messages_come_whole_and_in_order_and_then_none(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    assert recv_message(router) is None
    assert not has_message(router)
    dealer.send_multipart([b"a", b"b"])
    dealer.send(b"c")
    _wait_readable(router)
    first = recv_message(router)
    assert first is not None and [f.bytes for f in first[1:]] == [b"a", b"b"]
    identity = first[0].bytes
    assert has_message(router)
    second = recv_message(router)
    assert second is not None and [f.bytes for f in second] == [identity, b"c"]
    assert not has_message(router)
    assert recv_message(router) is None


def test_a_reply_reaches_its_peer_and_a_full_queue_says_so(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    dealer.send(b"hello")
    _wait_readable(router)
    got = recv_message(router)
    assert got is not None
    identity = got[0].bytes
    assert send_message(router, [identity], b"reply")
    _wait_readable(dealer)
    assert dealer.recv_multipart() == [b"reply"]
    # the dealer stops reading: its queue and the router's fill, then a send is refused whole
    # (a ROUTER says so only when told to: without ROUTER_MANDATORY it drops the message)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sent = 0
    while send_message(router, [identity], b"x%d" % sent):
        sent += 1
        assert sent < 10_000, "the high-water mark never refused a message"
    _wait_readable(dealer)
    assert [dealer.recv() for _ in range(sent)] == [b"x%d" % i for i in range(sent)]
