"""The data plane's connections: what the ROUTER's monitor reports, and a cap on how many are served.

libzmq accepts every connection that reaches the ROUTER (TCP or IPC) and reports it on the
socket's monitor as EVENT_ACCEPTED, whose value is the accepted descriptor; EVENT_DISCONNECTED
follows when it closes, sent before libzmq closes that descriptor, so the monitor tells the
story of each descriptor number in order. `ConnectionTracker` reads those events on the loop
thread. A connection accepted while ``max_connections`` are open is refused: it is shut down at
once (``shutdown(SHUT_RDWR)`` on a duplicate of its descriptor, which ends the stream for libzmq
too: libzmq then closes its own descriptor and reports EVENT_DISCONNECTED), counted, and kept
from the connection listeners, so nothing about it reaches the liveness machinery. Its peer sees
the connection close before a single message (a ZMQ client reconnects, and is refused again
while the cap holds). Connections already open are served as before.

A refused connection costs one descriptor for the moment between libzmq's accept and its close,
so the cap must leave room under the open-files limit: `Settings.connection_cap`
(`dataplane.server.config`) holds ``FD_KEEP`` descriptors back beyond it, and the registrations'
descriptor reserve (`dataplane.memory.budget.DescriptorReserve`) keeps free, besides its own
reserve, the room the cap still allows (`ConnectionTracker.room`).

The one race left: a refused connection that its peer closes after the loop read every pending
event but before the shutdown, whose descriptor number libzmq reuses for a new connection in
between, makes the shutdown end that new connection instead (its client reconnects). The loop
reads every pending event before it shuts anything down, so a close already reported is never
mistaken for an open connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from dataplane.metrics import DataPlaneMetrics

logger = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
Event = tuple[int, bool]  # (descriptor, connected)


class ConnectionTracker:
    """The connections open on the data plane, by descriptor, and the cap on them. Loop thread
    only, except ``room`` and ``open_count`` (plain ints a pool thread may read stale)."""

    def __init__(
        self,
        max_connections: int | None,
        metrics: DataPlaneMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_connections = max_connections  # None: no cap
        self._metrics = metrics
        self._clock = clock
        self._open: set[int] = set()  # served, by descriptor
        self._refused: set[int] = set()  # shut down, until libzmq reports them closed
        self.open_count = 0
        self.refused_total = 0
        self._warned_at: float | None = None
        self._unwarned = 0  # refusals since the last warning
        metrics.connections_max.set(max_connections or 0)

    def room(self) -> int:
        """Connections the cap still allows (0 without a cap: nothing to keep free for)."""
        if self.max_connections is None:
            return 0
        return max(0, self.max_connections - self.open_count)

    def drain(self, monitor: zmq.Socket[Any]) -> list[Event]:
        """Every event pending on ``monitor``, in order; connections past the cap refused. Returns
        the events of the served connections, for the connection listeners."""
        raw: list[tuple[int, int]] = []
        while True:
            try:
                msg = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = int.from_bytes(msg[0][:2], "little")
            if event in (zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED):
                raw.append((event, int.from_bytes(msg[0][2:6], "little", signed=True)))
        closed_at = {fd: i for i, (event, fd) in enumerate(raw) if event == zmq.EVENT_DISCONNECTED}
        out: list[Event] = []
        for i, (event, fd) in enumerate(raw):
            if event == zmq.EVENT_DISCONNECTED:
                if fd in self._refused:
                    self._refused.discard(fd)
                else:
                    self._open.discard(fd)
                    out.append((fd, False))
            elif self.max_connections is not None and len(self._open) >= self.max_connections:
                self._refuse(fd, closed=closed_at.get(fd, -1) > i)
            else:
                self._open.add(fd)
                out.append((fd, True))
        if raw:
            self.open_count = len(self._open)
            self._metrics.connections_open.set(self.open_count)
        return out

    def _refuse(self, fd: int, closed: bool) -> None:
        """Shut connection ``fd`` down (unless it already closed) and count it."""
        self._refused.add(fd)
        self.refused_total += 1
        self._metrics.connections_refused.inc()
        if not closed:
            shut_down(fd)
        self._unwarned += 1
        now = self._clock()
        if self._warned_at is None or now - self._warned_at >= WARN_EVERY_S:
            logger.warning(
                "server: %d connection(s) refused: %d open, max_connections=%d",
                self._unwarned,
                len(self._open),
                self.max_connections,
            )
            self._warned_at, self._unwarned = now, 0


def shut_down(fd: int) -> None:
    """End the connection of descriptor ``fd`` for both sides without closing ``fd`` (its owner,
    libzmq, sees the end of the stream and closes it). A descriptor that is no longer a socket
    (already closed) is left alone."""
    try:
        dup = os.dup(fd)
    except OSError:
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return
    with contextlib.suppress(OSError):  # (ENOTCONN: the peer already reset it)
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
