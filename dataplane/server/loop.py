"""The server loop: one ROUTER socket owned by one thread, two worker pools, ordered transfers.

    client DEALER ──► ROUTER (loop thread) ──► decode + validate ──► LOOP handler (inline)
                                                        ├──► NORMAL pool  (control, lookup)
                                                        └──► transfer pool (STORE/RETRIEVE,
                                                              ordered per instance; one that
                                                              cannot wait runs inline when none
                                                              of its instance's is queued)
    pool thread ──► reply queue + eventfd wake-up ──► loop thread sends the reply

ZMQ sockets are not thread-safe, so only the loop thread touches the ROUTER. Pool threads hand
replies back through a queue and wake the loop with an eventfd, which any thread may write.
A bad request gets an error reply; a handler exception becomes an error reply to that request.
A connection past ``max_connections`` is shut down as it is accepted (`dataplane.server.connections`).
Shutdown (``stop``) stops reading new requests, answers requests that arrive meanwhile with
SHUTTING_DOWN, drains the in-flight ones within a bound, then closes the socket.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from dataplane import __version__
from dataplane.memory.copies import spawn_all
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Deferred, Handler, HandlerKind, Module, RequestContext, ServerInfo
from dataplane.server.connections import ConnectionTracker
from dataplane.server.early import StartGate, open_router
from dataplane.server.ordered import KeyedSerialExecutor
from dataplane.wire.errors import (
    KVWardenError,
    LimitExceeded,
    NotOwner,
    ProtocolError,
    ServerError,
    ShuttingDown,
    Unsupported,
)
from dataplane.wire.frames import has_message, recv_message, send_message
from dataplane.wire.messages import MsgType
from dataplane.wire.protocol import (
    PROTOCOL_VERSION,
    decode_request,
    encode_error,
    encode_ok,
    peek_request_id,
    unpack,
)

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
        self._handlers: dict[MsgType, Handler] = {}
        self._modules: list[Module] = []
        self._conn_listeners: list[ConnListener] = []
        self._ctx, self._sock, self._monitor = open_router(endpoint, max_frame_bytes)
        self.connections = ConnectionTracker(max_connections, self.metrics)  # loop thread only
        self.bound_endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pool_sizes = (max_cpu_workers, max_transfer_workers)
        self._normal = ThreadPoolExecutor(max_cpu_workers, thread_name_prefix="kvwarden-normal")
        self._transfer_pool = ThreadPoolExecutor(max_transfer_workers, thread_name_prefix="kvwarden-transfer")
        self._transfer = KeyedSerialExecutor(self._transfer_pool)
        self._pools_shut = threading.Event()  # set once both pools were shut down
        self._replies: queue.SimpleQueue[tuple[list[bytes], bytes]] = queue.SimpleQueue()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # guards _wake_fd against close while a late pool thread writes to it (a closed fd
        # number may be reused by another file)
        self._wake_lock = threading.Lock()
        self._state = Lifecycle.CREATED
        self._state_lock = threading.Lock()  # guards _state transitions
        self._inflight = 0  # loop thread only
        self._thread: threading.Thread | None = None
        self.loop_error: BaseException | None = None
        self._gate: StartGate | None = None  # while STARTING (loop thread only, once started)

    # ------------------------------------------------------------------ wiring
    def add_module(self, module: Module) -> None:
        for mtype, handler in module.handlers().items():
            if mtype in self._handlers:
                raise ValueError(f"{mtype} already has a handler")
            self._handlers[mtype] = handler
        self._modules.append(module)

    def add_connection_listener(self, fn: ConnListener) -> None:
        """``fn(fd, connected)`` runs on the loop thread for every peer connect/disconnect."""
        self._conn_listeners.append(fn)

    def info(self, chunk_size: int) -> ServerInfo:
        """Who this server is (what HELLO answers), for a data plane of ``chunk_size``."""
        return ServerInfo(self.server_id, self.boot_token, self.version, PROTOCOL_VERSION, self.started_at,
                          self.bound_endpoint, chunk_size, self.max_frame_bytes)  # fmt: skip

    @property
    def state(self) -> Lifecycle:
        return self._state

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pools_alive(self) -> bool:
        """Both worker pools still accept work (False once they were shut down)."""
        return not self._pools_shut.is_set()

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
        spawn_all(self._normal, self._pool_sizes[0])
        spawn_all(self._transfer_pool, self._pool_sizes[1])
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
        self._pools_shut.set()
        self._normal.shutdown(wait=False, cancel_futures=True)
        self._transfer_pool.shutdown(wait=False, cancel_futures=True)
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
                    if (self._inflight == 0 and self._gate is None) or now > drain_deadline:
                        if self._inflight:
                            logger.error("server: %d request(s) still in flight at shutdown", self._inflight)
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
        while True:
            try:
                envelope, data = self._replies.get_nowait()
            except queue.Empty:
                return
            self._inflight -= 1
            self._send(envelope, data)

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
        handler = gate.handlers[req.type] if gate is not None else self._handlers.get(req.type)
        if handler is None:
            err = Unsupported(f"{req.type} has no handler on this server")
            self._send(envelope, encode_error(req.request_id, err))
            return
        rctx = RequestContext(req.request_id, req.type, fd)
        key = handler.order_key(req.payload) if handler.order_key is not None else None
        if handler.kind is HandlerKind.LOOP:
            self._send(envelope, self._call(handler, rctx, req.payload))
            return
        if self._inline(handler, req.payload, key):
            inline = RequestContext(req.request_id, req.type, fd, inline=True)
            with contextlib.suppress(Deferred):  # it would wait after all: on to the pool
                self._send(envelope, self._call(handler, inline, req.payload))
                return
        self._inflight += 1

        def task() -> None:
            data = self._call(handler, rctx, req.payload)
            self._replies.put((envelope, data))
            self._wake()

        if handler.kind is HandlerKind.TRANSFER and key is not None:
            self._transfer.submit(key, task)
        else:
            self._normal.submit(task)

    def _inline(self, handler: Handler, payload: Any, key: int | None) -> bool:
        """A TRANSFER request the loop answers itself (`Handler.inline`): in order, since no
        earlier one with its key waits or runs."""
        if handler.inline is None or key is None or self._transfer.busy(key):
            return False
        return handler.inline(payload)

    def _call(self, handler: Handler, rctx: RequestContext, payload: Any) -> bytes:
        t0 = time.perf_counter()
        try:
            result = handler.fn(rctx, payload)
            data = encode_ok(rctx.request_id, result)
            outcome = "ok"
        except KVWardenError as exc:
            data = encode_error(rctx.request_id, exc)
            outcome = "error"
            if isinstance(exc, LimitExceeded):
                self.metrics.limits_exceeded.labels(limit=exc.limit).inc()
            elif isinstance(exc, NotOwner):
                self.metrics.not_owner.inc()
        except Exception as exc:
            if isinstance(exc, Deferred) and rctx.inline:
                raise  # (the caller hands it to the pool)
            logger.exception("server: %s handler failed", rctx.type)
            data = encode_error(rctx.request_id, ServerError(f"{rctx.type} failed: {exc}"))
            outcome = "error"
        m = self.metrics
        m.duration.labels(type=rctx.type.value).observe(time.perf_counter() - t0)
        m.requests.labels(type=rctx.type.value, outcome=outcome).inc()
        return data
