"""The staged start (`dataplane.server.early`): a server started early answers HELLO,
GET_SERVER_INFO and PING at once from its identity, holds every other request in arrival order
(with the connection events seen meanwhile) and serves them when `start` opens it; a stop while
starting answers what it held with SHUTTING_DOWN; a full hold refuses with LIMIT_EXCEEDED."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zmq

from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.server import early
from dataplane.server.early import StartGate
from dataplane.server.loop import Lifecycle, Server
from dataplane.wire.messages import Hello, Lookup, MsgType, Ping
from dataplane.wire.protocol import decode_reply, encode_message
from dataplane.wire.replies import Hits
from tests.conftest import DealerFactory
from tests.dataplane.registration import SECRET
from tests.helpers import error_of, wait_until

WAIT_S = 30.0


class Lookups:
    """A module answering LOOKUP with the request's first token (the order they were served)."""

    name = "lookups"

    def __init__(self) -> None:
        self.served: list[int] = []

    def handlers(self) -> dict[MsgType, Handler]:
        return {MsgType.LOOKUP: Handler(self._lookup)}

    def _lookup(self, _rctx: RequestContext, p: Lookup) -> Hits:
        self.served.append(int(p.token_ids[0]))
        return Hits(int(p.token_ids[0]), 0)  # the first token, to tell the replies apart

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None


def early_server() -> Server:
    server = Server("tcp://127.0.0.1:*", metrics=DataPlaneMetrics())
    server.start_early(StartGate(server.info(256), server.metrics))
    return server


def lookup(n: int) -> Lookup:
    return Lookup(9, SECRET, np.array([n, 0], dtype="<i4"))


def replies(sock: zmq.Socket[Any], n: int) -> dict[int, Any]:
    out = {}
    for _ in range(n):
        assert sock.poll(int(WAIT_S * 1000)), "no reply"
        r = decode_reply(sock.recv())
        out[r.request_id] = r
    return out


def test_hello_and_ping_are_answered_while_the_rest_waits_for_start(make_dealer: DealerFactory) -> None:
    server = early_server()
    events: list[tuple[int, bool]] = []
    try:
        assert server.state is Lifecycle.STARTING
        sock = make_dealer(server.bound_endpoint)
        for i in range(5):
            sock.send(encode_message(100 + i, lookup(i)))  # held
        sock.send(encode_message(1, Ping(9, SECRET)))
        sock.send(encode_message(2, Hello()))
        got = replies(sock, 2)
        assert got[1].ok and got[1].body == {"boot_token": server.boot_token, "tracked": False}
        assert got[2].ok and got[2].body["boot_token"] == server.boot_token
        assert got[2].body["chunk_size"] == 256
        assert not sock.poll(200)  # the LOOKUPs wait: no module handles them yet
        module = Lookups()
        server.add_module(module)
        server.add_connection_listener(lambda fd, connected: events.append((fd, connected)))
        server.start()
        held = replies(sock, 5)
        assert [held[100 + i].body["hit_tokens"] for i in range(5)] == list(range(5))
        assert module.served == list(range(5))  # in arrival order
        assert server.state is Lifecycle.RUNNING
        assert any(connected for _, connected in events)  # the connection made while starting
        sock.send(encode_message(3, lookup(7)))
        assert replies(sock, 1)[3].body == {"hit_tokens": 7, "pending_tokens": 0}
    finally:
        assert server.stop(5.0)


def test_a_stop_while_starting_answers_what_it_held(make_dealer: DealerFactory) -> None:
    server = early_server()
    sock = make_dealer(server.bound_endpoint)
    sock.send(encode_message(5, lookup(1)))
    sock.send(encode_message(6, Ping(None, None)))
    assert replies(sock, 1)[6].ok  # (the LOOKUP is held by now: it arrived first)
    assert server.stop(5.0)
    r = replies(sock, 1)[5]
    assert error_of(r)[0] == "SHUTTING_DOWN"
    assert server.state is Lifecycle.STOPPED


def test_a_full_hold_refuses_with_a_reason(
    make_dealer: DealerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(early, "MAX_HELD", 2)
    server = early_server()
    try:
        sock = make_dealer(server.bound_endpoint)
        for i in range(3):
            sock.send(encode_message(10 + i, lookup(i)))
        r = replies(sock, 1)[12]
        code, message = error_of(r)
        assert code == "LIMIT_EXCEEDED" and "starting" in message and "2 requests" in message
        server.add_module(Lookups())
        server.start()
        got = replies(sock, 2)
        assert sorted(got) == [10, 11] and all(x.ok for x in got.values())
        wait_until(lambda: server.state is Lifecycle.RUNNING, WAIT_S, 0.01, what="running")
    finally:
        assert server.stop(5.0)
