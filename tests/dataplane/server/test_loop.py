"""The server loop's promises, at the module seam: an in-process `Server` with hand-made modules
(`Server.add_module` with an object giving ``handlers()`` and ``start/stop/close``), driven over
real ZMQ sockets.

A handler exception becomes an INTERNAL reply and the loop goes on; a request that arrives while
the server drains gets SHUTTING_DOWN while the in-flight one still gets its reply; a type no
module handles gets UNSUPPORTED; transfers of one instance run in arrival order without holding
another instance's back, one answered inline that defers included; connections past
``max_connections`` are closed at once, counted, and never reach the connection listeners; and
a client's request that gets no reply raises `RequestTimeout`.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from dataplane.client import WorkerAdapter
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Deferred, Handler, RequestContext
from dataplane.server.loop import Lifecycle, Server
from dataplane.wire.errors import RequestTimeout
from dataplane.wire.messages import EngineReserve, Hello, Lookup, Message, MsgType, Ping, Store
from dataplane.wire.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    ReplyFrame,
    decode_reply,
    decode_request,
    encode_message,
    unpack,
)
from dataplane.wire.replies import Hits, PingReply, Reserved, StoreCounts
from dataplane.wire.table import SPECS, HandlerKind
from tests.conftest import DealerFactory
from tests.dataplane.registration import SECRET
from tests.helpers import call, error_of, next_rid, wait_until

PONG = PingReply(7, None)
PONG_BODY = {"boot_token": 7, "tracked": None}  # as it travels
WAIT_S = 30.0  # bound on any wait for the server (a shared 2-core machine can be slow)

Sock = zmq.Socket[Any]


class HandMade:
    """A module made of the handlers it is given; it counts its lifecycle calls."""

    def __init__(self, name: str, handlers: dict[MsgType, Handler]) -> None:
        self.name = name
        self._handlers = handlers
        self.calls: list[str] = []

    def handlers(self) -> dict[MsgType, Handler]:
        return dict(self._handlers)

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")

    def close(self) -> None:
        self.calls.append("close")


def pong(_rctx: RequestContext, _p: Ping) -> PingReply:
    return PONG


PING_HANDLER = Handler(pong)


def seq_reply(p: Store) -> StoreCounts:
    """A STORE's reply carrying the request's sequence number (as ``chunks``)."""
    return StoreCounts(seq_of(p), 0, 0, 0, 0)


def seq_body(seq: int) -> dict[str, int]:
    """``seq_reply``'s body as it travels."""
    return {"chunks": seq, "stored": 0, "present": 0, "rejected": 0, "skipped": 0}


def reserve(instance_id: int, seq: int) -> EngineReserve:
    """An ENGINE_RESERVE (a row answered inline when it cannot wait) carrying ``seq`` as
    ``store`` does."""
    return EngineReserve(instance_id, SECRET, np.array([seq], dtype="<i4"), 0, 0)


def lease_reply(p: EngineReserve) -> Reserved:
    """A reserve's reply carrying the request's sequence number (as ``lease``)."""
    return Reserved(seq_of(p), (), 0, 0, 0, 0, 0, 0)


def lease_body(seq: int) -> dict[str, Any]:
    """``lease_reply``'s body as it travels."""
    zero = dict.fromkeys(("slot_bytes", "present", "rejected", "skipped", "chunks", "usable"), 0)
    return {"lease": seq, "slots": [], **zero}


def by_instance(p: Store | EngineReserve) -> int:
    return p.instance_id


def store(instance_id: int, seq: int) -> Store:
    """A STORE whose single token id carries ``seq`` (the handlers below read it back)."""
    return Store(instance_id, SECRET, np.array([seq], dtype="<i4"), np.array([0], dtype="<i4"))


def seq_of(p: Store | EngineReserve) -> int:
    return int(p.token_ids[0])


ServerFactory = Callable[..., Server]


@pytest.fixture
def make_loop() -> Iterator[ServerFactory]:
    """Started in-process servers with the given modules; every one stopped at teardown."""
    made: list[Server] = []

    def make(*modules: HandMade, **kw: Any) -> Server:
        server = Server("tcp://127.0.0.1:*", **kw)
        made.append(server)
        for m in modules:
            server.add_module(m)
        server.start()
        return server

    yield make
    for server in made:
        assert server.stop(5.0), "server did not stop within its bound"


def send(sock: Sock, msg: Message) -> int:
    rid = next_rid()
    sock.send(encode_message(rid, msg))
    return rid


def request(sock: Sock, msg: Message, timeout: float = WAIT_S) -> tuple[int, ReplyFrame]:
    rid = next_rid()
    reply = call(sock, encode_message(rid, msg), timeout)
    assert reply.request_id == rid, reply
    return rid, reply


def receive(sock: Sock, timeout: float = WAIT_S) -> ReplyFrame:
    assert sock.poll(int(timeout * 1000), zmq.POLLIN), f"no reply within {timeout:g}s"
    return decode_reply(sock.recv())


def assert_pong(sock: Sock) -> None:
    _, reply = request(sock, Ping(None, None))
    assert reply.ok and reply.body == PONG_BODY, reply


# ------------------------------------------------------------------- handler exceptions


@pytest.mark.parametrize(
    "msg",
    [Hello(), Lookup(5, SECRET, np.arange(4, dtype="<i4")), store(5, 0)],
    ids=["loop", "normal", "transfer"],
)
def test_a_handler_exception_becomes_an_internal_reply_and_the_loop_goes_on(
    make_loop: ServerFactory, make_dealer: DealerFactory, msg: Message[Any]
) -> None:
    def explode(_rctx: RequestContext, _p: Any) -> Any:
        raise RuntimeError("handler exploded")

    order_key = by_instance if SPECS[msg.TYPE].kind is HandlerKind.TRANSFER else None
    server = make_loop(
        HandMade("faulty", {msg.TYPE: Handler(explode, order_key), MsgType.PING: PING_HANDLER})
    )
    sock = make_dealer(server.bound_endpoint)
    _, reply = request(sock, msg)
    code, message = error_of(reply)
    assert code == "INTERNAL"
    assert msg.TYPE.value in message and "handler exploded" in message, message
    assert_pong(sock)  # the very next request is answered: the loop went on
    # and a second failure is answered just the same
    _, again = request(sock, msg)
    assert error_of(again)[0] == "INTERNAL"
    assert server.is_alive() and server.loop_error is None
    assert server.state is Lifecycle.RUNNING


# ------------------------------------------------------------------------- SHUTTING_DOWN


def test_a_request_arriving_while_draining_gets_shutting_down_and_the_inflight_one_its_reply(
    make_loop: ServerFactory, make_dealer: DealerFactory
) -> None:
    entered, release = threading.Event(), threading.Event()
    handled: list[int] = []

    def blocking_store(_rctx: RequestContext, p: Store) -> StoreCounts:
        handled.append(seq_of(p))
        entered.set()
        if not release.wait(WAIT_S):
            raise RuntimeError("the test never released the transfer")
        return seq_reply(p)

    module = HandMade(
        "blocking",
        {
            MsgType.PING: PING_HANDLER,
            MsgType.STORE: Handler(blocking_store, by_instance),
        },
    )
    # a drain bound far above the test's own waits: the server drains until released
    server = make_loop(module, drain_timeout_s=60.0)
    inflight = make_dealer(server.bound_endpoint)
    late = make_dealer(server.bound_endpoint)
    assert_pong(late)  # connected before the drain starts
    rid = send(inflight, store(1, 0))
    assert entered.wait(WAIT_S), "the transfer handler never ran"

    stopped: list[bool] = []
    stopper = threading.Thread(target=lambda: stopped.append(server.stop()), name="test-stopper")
    stopper.start()
    try:
        wait_until(lambda: server.state is Lifecycle.DRAINING, WAIT_S, what="the server to drain")
        # background work is stopped first; the modules' state is not closed while draining
        wait_until(lambda: module.calls == ["start", "stop"], WAIT_S, what="the modules to stop")
        for msg in (Ping(None, None), store(2, 1), Hello()):
            _, reply = request(late, msg)
            code, message = error_of(reply)
            assert code == "SHUTTING_DOWN", (msg, reply)
            assert "stopping" in message
        assert handled == [0]  # nothing that arrived while draining reached a handler
        assert stopper.is_alive() and stopped == []  # stop() waits for the in-flight transfer
        assert server.state.value == "draining"  # still draining while the transfer runs
        assert not inflight.poll(0, zmq.POLLIN)  # and that transfer has no reply yet
        assert module.calls == ["start", "stop"]
    finally:
        release.set()
        stopper.join(WAIT_S)
    assert not stopper.is_alive(), "stop() did not return after the transfer was released"
    assert stopped == [True]
    reply = receive(inflight)
    assert reply.ok and reply.request_id == rid and reply.body == seq_body(0), reply
    assert server.state is Lifecycle.STOPPED
    assert module.calls == ["start", "stop", "close"]


# --------------------------------------------------------------------------- UNSUPPORTED


def test_a_valid_request_no_module_handles_gets_unsupported(
    make_loop: ServerFactory, make_dealer: DealerFactory
) -> None:
    server = make_loop(HandMade("ping-only", {MsgType.PING: PING_HANDLER}))
    sock = make_dealer(server.bound_endpoint)
    for msg in (Hello(), store(3, 0), Lookup(3, SECRET, np.arange(2, dtype="<i4"))):
        _, reply = request(sock, msg)
        code, message = error_of(reply)
        assert code == "UNSUPPORTED", (msg, reply)
        assert msg.TYPE.value in message, message
    assert_pong(sock)  # the handled type is still answered
    assert server.is_alive() and server.loop_error is None


# ------------------------------------------------------------------------- ordering


def test_transfers_of_one_instance_run_in_arrival_order_without_holding_another_instance(
    make_loop: ServerFactory, make_dealer: DealerFactory
) -> None:
    first, other = 11, 22
    entered, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    events: list[tuple[str, int, int]] = []  # (start | end, instance, seq)

    def recording_store(_rctx: RequestContext, p: Store) -> StoreCounts:
        key = (p.instance_id, seq_of(p))
        with lock:
            events.append(("start", *key))
        if key == (first, 0):
            entered.set()
            if not release.wait(WAIT_S):
                raise RuntimeError("the test never released the first transfer")
        with lock:
            events.append(("end", *key))
        return seq_reply(p)

    module = HandMade("ordered", {MsgType.STORE: Handler(recording_store, by_instance)})
    # enough transfer threads that unordered requests of `first` would overtake the blocked one
    server = make_loop(module, max_transfer_workers=4)
    sock = make_dealer(server.bound_endpoint)
    try:
        # back to back on one connection: the server reads them in this order, so by the time
        # `other`'s reply comes back every request of `first` has arrived
        rids = [send(sock, store(first, seq)) for seq in range(4)]
        other_rid = send(sock, store(other, 0))
        assert entered.wait(WAIT_S), "the first transfer never ran"
        reply = receive(sock)
        assert reply.ok and reply.request_id == other_rid, reply  # not held behind `first`
        with lock:
            started = [(i, s) for what, i, s in events if what == "start"]
        # two pool threads ran these two; the rest of `first` waits its turn
        assert sorted(started) == [(first, 0), (other, 0)]
        assert not release.is_set()  # ... while the first is still blocked
    finally:
        release.set()
    replies = [receive(sock) for _ in range(4)]
    assert all(r.ok for r in replies), replies
    assert [r.request_id for r in replies] == rids
    assert [r.body["chunks"] for r in replies] == [0, 1, 2, 3]
    with lock:
        mine = [(what, s) for what, i, s in events if i == first]
    # one at a time, in arrival order: each starts only after the one before it ended
    assert mine == [(what, s) for s in range(4) for what in ("start", "end")]


def test_a_transfer_that_cannot_wait_runs_on_the_loop_unless_its_instance_has_one_queued(
    make_loop: ServerFactory, make_dealer: DealerFactory
) -> None:
    first, other = 11, 22
    entered, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    ran: list[tuple[int, int, str]] = []  # (instance, seq, thread name)

    def recording_store(_rctx: RequestContext, p: EngineReserve) -> StoreCounts:
        with lock:
            ran.append((p.instance_id, seq_of(p), threading.current_thread().name))
        if (p.instance_id, seq_of(p)) == (first, 0):
            entered.set()
            if not release.wait(WAIT_S):
                raise RuntimeError("the test never released the first transfer")
        return lease_reply(p)

    def quick(p: EngineReserve) -> bool:  # seq 0 stands for a transfer that may wait
        return seq_of(p) > 0

    handler = Handler(recording_store, by_instance, quick)
    server = make_loop(HandMade("inline", {MsgType.ENGINE_RESERVE: handler}), max_transfer_workers=4)
    sock = make_dealer(server.bound_endpoint)
    _, reply = request(sock, reserve(other, 1))
    assert reply.ok and reply.body == lease_body(1), reply
    assert ran == [(other, 1, "kvwarden-loop")]
    try:
        rids = [send(sock, reserve(first, 0))]
        assert entered.wait(WAIT_S), "the first transfer never ran"
        rids.append(send(sock, reserve(first, 1)))  # cannot wait, but must not overtake seq 0
        _, reply = request(sock, reserve(other, 2))  # answered while `first` is blocked
        assert reply.ok and reply.body == lease_body(2), reply
        with lock:
            assert ran[1:] == [(first, 0, ran[1][2]), (other, 2, "kvwarden-loop")], ran
        assert ran[1][2].startswith("kvwarden-transfer")
    finally:
        release.set()
    replies = [receive(sock) for _ in range(2)]
    assert [(r.request_id, r.body) for r in replies] == [(rids[0], lease_body(0)), (rids[1], lease_body(1))]
    with lock:
        assert ran[3][:2] == (first, 1) and ran[3][2].startswith("kvwarden-transfer"), ran


def test_an_inline_transfer_that_defers_runs_on_the_pool_and_keeps_its_place(
    make_loop: ServerFactory, make_dealer: DealerFactory
) -> None:
    """A handler called inline (``rctx.inline``) that raises `Deferred` is run again on the
    transfer pool, and its instance's next transfer, which could run inline, waits its turn."""
    inst = 33
    entered, release = threading.Event(), threading.Event()
    lock = threading.Lock()
    ran: list[tuple[int, bool, str]] = []  # (seq, inline, thread name)

    def deferring_store(rctx: RequestContext, p: EngineReserve) -> StoreCounts:
        with lock:
            ran.append((seq_of(p), rctx.inline, threading.current_thread().name))
        if seq_of(p) == 1 and rctx.inline:
            raise Deferred  # it would wait after all
        if seq_of(p) == 1:
            entered.set()
            if not release.wait(WAIT_S):
                raise RuntimeError("the test never released the deferred transfer")
        return lease_reply(p)

    handler = Handler(deferring_store, by_instance, lambda _p: True)
    server = make_loop(HandMade("defer", {MsgType.ENGINE_RESERVE: handler, MsgType.PING: PING_HANDLER}))
    sock = make_dealer(server.bound_endpoint)
    try:
        rids = [send(sock, reserve(inst, 1))]
        assert entered.wait(WAIT_S), "the deferred transfer never ran on the pool"
        rids.append(send(sock, reserve(inst, 2)))  # may run inline, but must not overtake seq 1
        assert_pong(sock)  # the loop is free meanwhile
    finally:
        release.set()
    replies = [receive(sock) for _ in range(2)]
    assert [(r.request_id, r.body) for r in replies] == [(rids[0], lease_body(1)), (rids[1], lease_body(2))]
    with lock:
        assert [(seq, inline) for seq, inline, _ in ran] == [(1, True), (1, False), (2, False)], ran
        assert ran[0][2] == "kvwarden-loop" and all(t.startswith("kvwarden-transfer") for *_, t in ran[1:])


# -------------------------------------------------------------------------- connection cap


def closed_by_server(port: int) -> bool:
    """A new TCP connection to ``port`` is closed by the server within WAIT_S (its ZMTP greeting
    may come first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:
        try:
            while s.recv(4096):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
    return True


def test_connections_past_max_connections_are_refused_and_never_reach_the_listeners(
    make_loop: ServerFactory, make_dealer: DealerFactory
) -> None:
    metrics = DataPlaneMetrics()
    server = make_loop(HandMade("ping", {MsgType.PING: PING_HANDLER}), max_connections=2, metrics=metrics)
    events: list[tuple[int, bool]] = []
    server.add_connection_listener(lambda fd, up: events.append((fd, up)))  # (loop thread)
    port = int(server.bound_endpoint.rsplit(":", 1)[1])

    def sample(name: str) -> float:
        value = metrics.registry.get_sample_value(name)
        assert value is not None, name
        return value

    first, second = make_dealer(server.bound_endpoint), make_dealer(server.bound_endpoint)
    assert_pong(first)
    assert_pong(second)
    assert closed_by_server(port)  # the third: closed before a message
    wait_until(lambda: sample("kvwarden_connections_refused_total") >= 1, WAIT_S, what="the refusal counted")
    assert sample("kvwarden_connections_open") == 2 and sample("kvwarden_connections_max") == 2
    assert [up for _, up in events] == [True, True], events  # the refused one never showed
    assert_pong(first)  # those open are served as before
    second.close(linger=0)
    wait_until(lambda: len(events) == 3, WAIT_S, what="the close reported")
    assert events[2] == (events[1][0], False) and sample("kvwarden_connections_open") == 1
    third = make_dealer(server.bound_endpoint)  # room again: served
    assert_pong(third)
    assert server.connections.open_count == 2 and server.connections.room() == 0


# ------------------------------------------------------------------- client request timeout

REQUEST_TIMEOUT_S = 1.0  # the error names the timeout that ran out: this one, not the default 30 s


@pytest.mark.parametrize(
    ("request_fn", "mtype"),
    [
        (lambda w: w.server_info(), MsgType.HELLO),
        (lambda w: w.lookup(np.arange(16, dtype="<i4")), MsgType.LOOKUP),
    ],
    ids=["hello", "lookup"],
)
def test_a_request_without_a_reply_raises_request_timeout_after_request_timeout(
    request_fn: Callable[[WorkerAdapter], Any], mtype: MsgType
) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)  # takes every request, answers none
    router.setsockopt(zmq.LINGER, 0)
    try:
        router.bind("tcp://127.0.0.1:*")
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        w = WorkerAdapter(endpoint, model_name="m", request_timeout=REQUEST_TIMEOUT_S)
        try:
            with pytest.raises(RequestTimeout) as info:
                request_fn(w)
        finally:
            w.close()
        # the adapter's request_timeout ran out (its error names it), not a connection wait
        assert str(info.value) == f"{mtype}: no reply within {REQUEST_TIMEOUT_S:g}s"
        # the request was delivered: the timeout is about the missing reply, not a connection
        assert router.poll(int(WAIT_S * 1000), zmq.POLLIN)
        got = decode_request(unpack(router.recv_multipart()[-1], DEFAULT_MAX_FRAME_BYTES))
        assert got.type is mtype
    finally:
        router.close(linger=0)
        ctx.term()


# ----------------------------------------------------------------- the protocol table's rows


def test_a_handler_answering_with_another_reply_type_gets_internal_and_the_loop_goes_on(
    make_loop: ServerFactory, make_dealer: DealerFactory
) -> None:
    def wrong(_rctx: RequestContext, _p: Store) -> Hits:
        return Hits(0, 0)  # STORE's row says StoreCounts

    server = make_loop(
        HandMade("wrong", {MsgType.STORE: Handler(wrong, by_instance), MsgType.PING: PING_HANDLER})
    )
    sock = make_dealer(server.bound_endpoint)
    _, reply = request(sock, store(1, 0))
    code, message = error_of(reply)
    assert code == "INTERNAL" and "returned Hits, not StoreCounts" in message, message
    assert_pong(sock)


@pytest.mark.parametrize(
    ("mtype", "handler", "what"),
    [
        (MsgType.STORE, Handler(pong), "order key"),  # a TRANSFER row without its order
        (MsgType.LOOKUP, Handler(pong, by_instance), "order key"),  # a NORMAL row with one
        (MsgType.STORE, Handler(pong, by_instance, lambda _p: True), "not answered inline"),
    ],
    ids=["transfer-unordered", "normal-ordered", "inline-not-declared"],
)
def test_a_module_whose_handlers_do_not_fit_their_rows_is_refused(
    mtype: MsgType, handler: Handler, what: str
) -> None:
    server = Server("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ValueError, match=what):
            server.add_module(HandMade("misfit", {mtype: handler}))
    finally:
        assert server.stop(5.0)
