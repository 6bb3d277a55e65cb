"""The server loop: one ROUTER socket owned by one thread, and the server's lifecycle.

    client DEALER ──► ROUTER (loop thread) ──► decode + validate ──► `Dispatcher` (where the
                                                                     protocol table says)
    pool thread ──► reply queue + eventfd wake-up ──► loop thread sends the reply

ZMQ sockets are not thread-safe, so only the loop thread touches the ROUTER. Pool threads hand
replies back through a queue and wake the loop with an eventfd, which any thread may write.
A bad request gets an error reply; a handler exception becomes an error reply to that request
(`dataplane.server.dispatch`).
A connection past ``max_connections`` is shut down as it is accepted (`dataplane.server.connections`).
Shutdown (``stop``) stops reading new requests, answers requests that arrive meanwhile with
SHUTTING_DOWN, drains the in-flight ones within a bound, then closes the socket.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from dataplane import __version__
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Module, ServerInfo
from dataplane.server.connections import ConnectionTracker
from dataplane.server.dispatch import Dispatcher
from dataplane.server.early import StartGate, open_router
from dataplane.wire.errors import KVWardenError, ProtocolError, ShuttingDown
from dataplane.wire.frames import has_message, recv_message, send_message
from dataplane.wire.protocol import PROTOCOL_VERSION, decode_request, encode_error, peek_request_id, unpack

logger = logging.getLogger(__name__)

_RECV_BATCH = 256
ConnListener = Callable[[int, bool], None]  # (fd, connected)


class Lifecycle(enum.Enum):
    CREATED = "created"
    STARTING = "starting"  # start_early: HELLO, GET_SERVER_INFO and PING answered, the rest held
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Server:
    def __init__(
        self,
        endpoint: str,
        *,
        max_cpu_workers: int = 4,
        max_transfer_workers: int = 2,
        max_frame_bytes: int = 16 << 20,
        metrics: DataPlaneMetrics | None = None,
        drain_timeout_s: float = 10.0,
        max_connections: int | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.server_id = uuid.uuid4().hex
        self.boot_token = secrets.randbits(63)
        self.version = __version__
        self.started_at = time.time()
        self.max_frame_bytes = max_frame_bytes
        self.metrics = metrics or DataPlaneMetrics()
        self._drain_timeout_s = drain_timeout_s
        self._modules: list[Module] = []
        self._conn_listeners: list[ConnListener] = []
        self._ctx, self._sock, self._monitor = open_router(endpoint, max_frame_bytes)
        self.connections = ConnectionTracker(max_connections, self.metrics)  # loop thread only
        self.bound_endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dispatch = Dispatcher(self.metrics, (max_cpu_workers, max_transfer_workers), self._wake)
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # guards _wake_fd against close while a late pool thread writes to it (a closed fd
        # number may be reused by another file)
        self._wake_lock = threading.Lock()
        self._state = Lifecycle.CREATED
        self._state_lock = threading.Lock()  # guards _state transitions
        self._thread: threading.Thread | None = None
        self.loop_error: BaseException | None = None
        self._gate: StartGate | None = None  # while STARTING (loop thread only, once started)

    # ------------------------------------------------------------------ wiring
    def add_module(self, module: Module) -> None:
        self._dispatch.add(module.handlers())
        self._modules.append(module)

    def add_connection_listener(self, fn: ConnListener) -> None:
        """``fn(fd, connected)`` runs on the loop thread for every peer connect/disconnect."""
        self._conn_listeners.append(fn)

    def info(self, chunk_size: int) -> ServerInfo:
        """Who this server is (what HELLO answers), for a data plane of ``chunk_size``."""
        return ServerInfo(
            self.server_id,
            self.boot_token,
            self.version,
            PROTOCOL_VERSION,
            self.started_at,
            self.bound_endpoint,
            chunk_size,
            self.max_frame_bytes,
        )

    @property
    def state(self) -> Lifecycle:
        return self._state

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pools_alive(self) -> bool:
        """Both worker pools still accept work (False once they were shut down)."""
        return self._dispatch.pools_alive()

    # --------------------------------------------------------------- lifecycle
    def start_early(self, gate: StartGate) -> None:
        """Run the loop now, answering through ``gate`` until `start` opens it
        (`dataplane.server.early`)."""
        with self._state_lock:
            if self._state is not Lifecycle.CREATED:
                raise RuntimeError(f"server is {self._state.value}")
            self._state = Lifecycle.STARTING
            self._gate = gate
        self._run_thread()

    def start(self) -> None:
        with self._state_lock:
            if self._state not in (Lifecycle.CREATED, Lifecycle.STARTING):
                raise RuntimeError(f"server is {self._state.value}")
            early = self._state is Lifecycle.STARTING
            if not early:
                self._state = Lifecycle.RUNNING
        self._dispatch.start()
        for m in self._modules:
            m.start()
        if self._gate is not None:  # the loop serves what it held, then runs
            self._gate.open()
            self._wake()
        else:
            self._run_thread()

    def _run_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvwarden-loop", daemon=True)
        self._thread.start()
        logger.info("server: listening on %s (boot token %d)", self.bound_endpoint, self.boot_token)

    def _open_gate(self, gate: StartGate) -> None:
        """Loop thread: the connection events and the requests held while starting, in order."""
        with self._state_lock:
            if self._state is Lifecycle.STARTING:
                self._state = Lifecycle.RUNNING
        self._gate = None
        for fd, connected in gate.events:
            for fn in self._conn_listeners:
                fn(fd, connected)
        for frames in gate.held:
            self._on_frames(frames)
        logger.info("server: open (%d request(s) held while starting)", len(gate.held))

    def stop(self, timeout_s: float | None = None) -> bool:
        """Drain and stop; True when every thread ended within the bound."""
        with self._state_lock:
            if self._state is Lifecycle.CREATED:
                self._state = Lifecycle.STOPPED
                self._close_resources()
                self._close_wake()
                return True
            if self._state not in (Lifecycle.RUNNING, Lifecycle.STARTING):
                return True
            self._state = Lifecycle.DRAINING
        bound = self._drain_timeout_s if timeout_s is None else timeout_s
        # background threads (reaper, monitors) stop first, so none acts on state being torn down
        for m in self._modules:
            m.stop()
        self._wake()
        clean = True
        if self._thread is not None:
            self._thread.join(bound + 2.0)
            if self._thread.is_alive():
                logger.error("server: loop thread still alive after %.1fs", bound + 2.0)
                clean = False
        self._dispatch.shutdown()
        for m in self._modules:
            m.close()
        self._close_wake()
        self._state = Lifecycle.STOPPED
        logger.info("server: stopped")
        return clean

    # -------------------------------------------------------------------- loop
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        wake_fd = self._wake_fd
        poller.register(wake_fd, zmq.POLLIN)
        drain_deadline: float | None = None
        try:
            while True:
                events = dict(poller.poll(100))
                if wake_fd in events:
                    self._drain_wake()
                gate = self._gate
                if gate is not None and (gate.opening or self._state is Lifecycle.DRAINING):
                    self._open_gate(gate)  # (draining: what it held is answered SHUTTING_DOWN first)
                self._send_replies()
                if self._monitor in events:
                    self._on_monitor()
                if self._sock in events:
                    self._recv_batch()
                if self._state is Lifecycle.DRAINING:
                    now = time.monotonic()
                    if drain_deadline is None:
                        drain_deadline = now + self._drain_timeout_s
                    inflight = self._dispatch.inflight
                    if (inflight == 0 and self._gate is None) or now > drain_deadline:
                        if inflight:
                            logger.error("server: %d request(s) still in flight at shutdown", inflight)
                        break
        except BaseException as exc:  # fatal: /health reports it
            self.loop_error = exc
            logger.exception("server: loop thread died")
        finally:
            self._close_resources()

    def _close_resources(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close()
        self._ctx.term()

    def _close_wake(self) -> None:
        with self._wake_lock:
            if self._wake_fd >= 0:
                os.close(self._wake_fd)
                self._wake_fd = -1

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_fd >= 0:
                os.eventfd_write(self._wake_fd, 1)

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._wake_fd)

    def _send_replies(self) -> None:
        while (done := self._dispatch.take_done()) is not None:
            self._send(*done)

    def _send(self, envelope: list[bytes], data: bytes) -> None:
        if not send_message(self._sock, envelope, data):
            logger.warning("server: reply dropped, peer not reading (high-water mark)")

    def _on_monitor(self) -> None:
        for fd, connected in self.connections.drain(self._monitor):  # (past the cap: refused)
            if self._gate is not None:
                self._gate.events.append((fd, connected))  # for the listeners, once open
            else:
                for fn in self._conn_listeners:
                    fn(fd, connected)

    def _recv_batch(self) -> None:
        for _ in range(_RECV_BATCH):
            frames = recv_message(self._sock)
            if frames is None:
                return
            self._on_frames(frames)
            if not has_message(self._sock):
                return

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        envelope = [f.bytes for f in frames[:-1]]
        body = frames[-1]
        try:
            fd = int(body.get(zmq.SRCFD))
        except zmq.ZMQError:
            fd = -1
        raw: Any = None
        try:
            if len(frames) < 2:
                raise ProtocolError("request has no frames after the identity")
            raw = unpack(body.buffer, self.max_frame_bytes)
            req = decode_request(raw)
        except Exception as exc:
            self.metrics.requests.labels(type="INVALID", outcome="error").inc()
            if isinstance(exc, KVWardenError):
                logger.debug("server: bad request: %s", exc)
            else:  # a validation gap: the request is refused, the loop goes on
                logger.exception("server: a request could not be validated")
                exc = ProtocolError(f"invalid request ({type(exc).__name__})")
            self._send(envelope, encode_error(peek_request_id(raw), exc))
            return
        gate = self._gate
        if gate is not None and req.type not in gate.handlers:
            refused = gate.hold(frames)
            if refused is not None:
                self._send(envelope, encode_error(req.request_id, refused))
            return
        if gate is None and self._state is not Lifecycle.RUNNING:
            self._send(envelope, encode_error(req.request_id, ShuttingDown("server is stopping")))
            return
        handlers = gate.handlers if gate is not None else self._dispatch.handlers
        self._dispatch.route(envelope, req, fd, handlers.get(req.type), self._send)
