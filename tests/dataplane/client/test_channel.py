"""`Channel` against a bare ROUTER: a real socket that takes requests and answers only when the
test says, and goes away when the test closes it (as a killed server's connections do).

Which wait ended a request (a closed connection, ``reconnect_wait_s``, its own timeout, an
abort) is told by its error and message, never by a stopwatch: this may run on a busy, shared
2-core machine. The polls' deadlines (``SLACK``) are guards only, far below the 30 s request
timeout the old behaviour waited out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from dataplane.client.channel import Channel
from dataplane.wire.errors import ProtocolError, RequestAborted, RequestTimeout
from dataplane.wire.messages import Hello
from dataplane.wire.protocol import PROTOCOL_VERSION, encode_ok, peek_request_id, unpack
from dataplane.wire.records import reply_to_wire
from dataplane.wire.replies import ServerHello
from kvbench.procs import free_port
from tests.helpers import wait_until

TIMEOUT = 30.0  # the request timeout: what a dead server used to cost
SLACK = 5.0  # polls' deadlines, for a loaded 2-core host; still far below TIMEOUT


class Outcome:
    """A request run in a thread: its result or error, and when it ended."""

    def __init__(self, chan: Channel, timeout_s: float) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.ended: float | None = None
        self._thread = threading.Thread(target=self._run, args=(chan, timeout_s), daemon=True)
        self._thread.start()

    def _run(self, chan: Channel, timeout_s: float) -> None:
        try:
            self.value = chan.request(Hello(), timeout_s)
        except BaseException as exc:
            self.error = exc
        self.ended = time.monotonic()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    c: zmq.Context[Any] = zmq.Context()
    yield c
    # term() blocks while any socket of the context is open: a channel that left its monitor
    # socket behind would hang here
    t = threading.Thread(target=c.term, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "context.term() hung: a socket (the monitor?) was left open"


UP = ServerHello("second", 1, "0", 5, 256, 1 << 20)  # the new server's HELLO


def bound_router(ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any], str]:
    r = ctx.socket(zmq.ROUTER)
    r.setsockopt(zmq.LINGER, 0)
    r.bind("tcp://127.0.0.1:*")
    return r, r.getsockopt_string(zmq.LAST_ENDPOINT)


def take_request(router: zmq.Socket[Any]) -> list[bytes]:
    assert router.poll(int(SLACK * 1000), zmq.POLLIN), "the request never arrived"
    return router.recv_multipart()


def lose_connection_in_flight(chan: Channel, router: zmq.Socket[Any]) -> None:
    """A request in flight (the server has it and will never answer) when the peer closes, as
    a killed server's kernel does: it ends at once."""
    first = Outcome(chan, TIMEOUT)
    take_request(router)
    assert first.ended is None  # in flight: nothing answers it
    router.close(linger=0)
    wait_until(lambda: first.ended is not None, SLACK, what="the in-flight request to end")
    # ended by the close (not by its 30 s timeout: that says "no reply within 30s")
    assert isinstance(first.error, RequestAborted), first.error
    assert str(first.error) == "HELLO: connection to the server closed"


def test_a_request_in_flight_ends_when_the_connection_closes(ctx: zmq.Context[Any]) -> None:
    router, endpoint = bound_router(ctx)
    chan = Channel(ctx, endpoint)
    try:
        lose_connection_in_flight(chan, router)
    finally:
        router.close(linger=0)
        chan.close()


def test_after_a_lost_connection_a_request_waits_at_most_reconnect_wait(ctx: zmq.Context[Any]) -> None:
    router, endpoint = bound_router(ctx)
    chan = Channel(ctx, endpoint, reconnect_wait_s=1.0)
    try:
        lose_connection_in_flight(chan, router)
        assert chan.connected is False
        # at once, while the socket may still hold the old connection's pipe: the request
        # must not be queued there and lost (it would wait TIMEOUT for a reply), it waits
        # reconnect_wait_s for a new connection: its error names that wait (1 s), not TIMEOUT
        with pytest.raises(RequestTimeout) as info:
            chan.request(Hello(), TIMEOUT)
        assert str(info.value) == "HELLO: no connection to the server within 1s"
    finally:
        router.close(linger=0)
        chan.close()


def test_after_a_lost_connection_the_channel_reconnects_to_a_new_server(ctx: zmq.Context[Any]) -> None:
    router, endpoint = bound_router(ctx)
    port = int(endpoint.rsplit(":", 1)[1])
    chan = Channel(ctx, endpoint)
    router2: zmq.Socket[Any] | None = None
    try:
        lose_connection_in_flight(chan, router)
        router2 = ctx.socket(zmq.ROUTER)  # a new server on the same port
        router2.setsockopt(zmq.LINGER, 0)
        router2.bind(f"tcp://127.0.0.1:{port}")
        second = Outcome(chan, TIMEOUT)
        ident, frame = take_request(router2)
        router2.send_multipart([ident, encode_ok(peek_request_id(unpack(frame, 1 << 20)), UP)])
        wait_until(lambda: second.ended is not None, SLACK, what="the reply")
        assert second.error is None and second.value == UP
        assert chan.connected is True
    finally:
        router.close(linger=0)
        if router2 is not None:
            router2.close(linger=0)
        chan.close()


def test_abort_ends_the_wait_for_a_connection(ctx: zmq.Context[Any]) -> None:
    chan = Channel(ctx, f"tcp://127.0.0.1:{free_port()}")  # nobody there
    try:
        asked: list[bool] = []
        with pytest.raises(RequestAborted) as info:
            chan.request(Hello(), TIMEOUT, abort=lambda: asked.append(True) or True)
        # the first check of abort (after one step of ABORT_POLL_S) ended the wait
        assert asked == [True]
        assert str(info.value) == "HELLO: abandoned, the server is unhealthy"
    finally:
        chan.close()


def test_before_its_first_connection_a_request_waits_its_own_timeout(ctx: zmq.Context[Any]) -> None:
    # a worker may start before its server: reconnect_wait_s is for a connection that was lost
    chan = Channel(ctx, f"tcp://127.0.0.1:{free_port()}", reconnect_wait_s=0.1)
    try:
        with pytest.raises(RequestTimeout) as info:
            chan.request(Hello(), 1.0)
        # its own timeout (1 s), not reconnect_wait_s (that would say "within 0.1s")
        assert str(info.value) == "HELLO: no connection to the server within 1s"
        assert chan.connected is False
    finally:
        chan.close()
        chan.close()  # twice: a no-op


def answer(router: zmq.Socket[Any], chan: Channel, body: Any) -> Outcome:
    """A HELLO sent on ``chan``, answered by ``router`` with ``body``; its outcome."""
    outcome = Outcome(chan, TIMEOUT)
    ident, frame = take_request(router)
    rid = peek_request_id(unpack(frame, 1 << 20))
    router.send_multipart([ident, msgpack.packb([PROTOCOL_VERSION, rid, True, body], default=reply_to_wire)])
    wait_until(lambda: outcome.ended is not None, SLACK, what="the reply")
    return outcome


def test_a_reply_is_typed_and_one_that_does_not_check_raises_naming_the_field(ctx: zmq.Context[Any]) -> None:
    router, endpoint = bound_router(ctx)
    chan = Channel(ctx, endpoint)
    try:
        good = answer(router, chan, UP)
        assert good.error is None and good.value == UP and isinstance(good.value, ServerHello)
        bad = answer(router, chan, {"server_id": "x"})
        assert bad.value is None and isinstance(bad.error, ProtocolError)
        assert "HELLO reply: fields missing ['boot_token'" in str(bad.error)
    finally:
        router.close(linger=0)
        chan.close()
