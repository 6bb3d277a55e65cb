"""A staged start: the server answers HELLO, GET_SERVER_INFO and PING before the data plane is
built, and holds every other request until it is.

Building the data plane imports torch (about a second, whatever the machine does meanwhile)
and reserves L1; until then a worker, an orchestrator's probe or a restarted engine would see
no server at all. `start_early` binds the server's socket at once and starts its loop with a
`StartGate`: the three cheap requests are answered from what is known before anything is built
(the server's identity and boot token, the chunk size; no instance is tracked yet, so a PING
naming one answers ``tracked: false``, as any fresh server does), and every other request is
held, in arrival order, up to ``MAX_HELD``, with the connection events seen meanwhile. `open`
(by `Server.start`, once every module is added) has the loop replay the events to the
connection listeners and serve the held requests, then the server runs as if started at once.
`open_router` binds the ROUTER socket every server listens on, started early or not. This module
imports neither torch nor the server loop: `kvwarden serve` calls it first.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import zmq

from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext, ServerInfo
from dataplane.wire.errors import LimitExceeded
from dataplane.wire.messages import Hello, MsgType, Ping
from dataplane.wire.replies import PingReply, ServerHello

MAX_HELD = 1024  # requests held while the data plane is built


class StartGate:
    """What the loop consults while the server starts. Loop thread only, except ``open`` (any
    thread: an Event)."""

    def __init__(self, info: ServerInfo, metrics: DataPlaneMetrics) -> None:
        self._hello = info.hello_body()
        self._boot_token = info.boot_token
        self._metrics = metrics
        self.handlers = {
            MsgType.HELLO: Handler(self._answer_hello),
            MsgType.GET_SERVER_INFO: Handler(self._answer_hello),
            MsgType.PING: Handler(self._answer_ping),
        }
        self.held: list[list[zmq.Frame]] = []
        self.events: list[tuple[int, bool]] = []  # (fd, connected), as the monitor saw them
        self._opening = threading.Event()

    def open(self) -> None:
        self._opening.set()

    @property
    def opening(self) -> bool:
        return self._opening.is_set()

    def hold(self, frames: list[zmq.Frame]) -> LimitExceeded | None:
        """Keep a request for later; the error to answer it with when too many are held."""
        if len(self.held) >= MAX_HELD:
            return LimitExceeded(
                f"the server is starting and already holds {MAX_HELD} requests: retry", "starting"
            )
        self.held.append(frames)
        return None

    def _answer_hello(self, rctx: RequestContext, _: Hello) -> ServerHello:
        return self._hello

    def _answer_ping(self, rctx: RequestContext, p: Ping) -> PingReply:
        self._metrics.pings.inc()
        return PingReply(self._boot_token, None if p.instance_id is None else False)


def _bind(sock: zmq.Socket[Any], endpoint: str) -> None:
    """Bind; an ``ipc://`` socket file is created readable and writable by this user only (the
    umask is set around the bind, so it never exists with wider permissions), so only processes
    of the server's user can connect."""
    if not endpoint.startswith("ipc://"):
        sock.bind(endpoint)
        return
    old = os.umask(0o177)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old)


def open_router(
    endpoint: str, max_frame_bytes: int
) -> tuple[zmq.Context[Any], zmq.Socket[Any], zmq.Socket[Any]]:
    """The server's bound ROUTER socket, its context and its connection monitor (OSError when
    the endpoint cannot be bound)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)  # let the last replies leave on close
    # a hard cap: frames up to 4x the limit still get a FRAME_TOO_LARGE reply; beyond it
    # libzmq drops the peer's connection rather than buffer an unbounded frame
    sock.setsockopt(zmq.MAXMSGSIZE, max(4 * max_frame_bytes, max_frame_bytes + (1 << 20)))
    try:
        _bind(sock, endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        ctx.term()
        raise OSError(f"cannot bind {endpoint}: {exc}") from None
    monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
    return ctx, sock, monitor
