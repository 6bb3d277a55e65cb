"""Where a decoded request runs and how its answer becomes a reply frame.

The protocol table (`dataplane.wire.table`) says, for every message type, where it runs and
which reply record answers it; a module supplies only the functions (`Handler`). This is the
one place that reads both:

    decoded request ──► LOOP row ──────────────► handler on the loop thread ──► reply frame
                    ├─► TRANSFER row, inline,     the loop thread, when no earlier request of
                    │   the module says it         its instance is queued or running (it may
                    │   will not wait ───────────► still raise `Deferred`: on to the pool)
                    ├─► TRANSFER row ────────────► transfer pool, per instance in arrival order
                    └─► NORMAL row ──────────────► NORMAL pool
    pool thread ──► ``done`` queue + ``wake()`` ──► the loop thread sends it (`Server`)

A handler's result must be its row's reply record: anything else is answered INTERNAL and
logged, never sent as it is. Pools and ``done`` are safe from any thread; ``inflight`` and the
handler table are the loop thread's.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dataplane.memory.copies import spawn_all
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Deferred, Handler, RequestContext
from dataplane.server.ordered import KeyedSerialExecutor
from dataplane.wire.errors import KVWardenError, LimitExceeded, NotOwner, ServerError, Unsupported
from dataplane.wire.kinds import MsgType
from dataplane.wire.protocol import Request, encode_error, encode_ok
from dataplane.wire.table import SPECS, HandlerKind

logger = logging.getLogger(__name__)

SendFrame = Callable[[list[bytes], bytes], None]  # (envelope, reply frame), on the loop thread


def check_handlers(handlers: dict[MsgType, Handler]) -> None:
    """A module's handlers fit their rows: TRANSFER ones name their order, only inline rows
    say when they may be answered inline (ValueError otherwise)."""
    for mtype, h in handlers.items():
        spec = SPECS[mtype]
        if (spec.kind is HandlerKind.TRANSFER) != (h.order_key is not None):
            raise ValueError(f"{mtype}: an order key is given exactly for TRANSFER rows")
        if h.inline is not None and not spec.inline:
            raise ValueError(f"{mtype}: its row is not answered inline")


class Dispatcher:
    def __init__(
        self, metrics: DataPlaneMetrics, pool_sizes: tuple[int, int], wake: Callable[[], None]
    ) -> None:
        self.metrics = metrics
        self._pool_sizes = pool_sizes
        self._shut = threading.Event()  # set once both pools were shut down
        self.normal = ThreadPoolExecutor(pool_sizes[0], thread_name_prefix="kvwarden-normal")
        self.transfer_pool = ThreadPoolExecutor(pool_sizes[1], thread_name_prefix="kvwarden-transfer")
        self._transfer = KeyedSerialExecutor(self.transfer_pool)
        self._wake = wake
        self.done: queue.SimpleQueue[tuple[list[bytes], bytes]] = queue.SimpleQueue()
        self.handlers: dict[MsgType, Handler] = {}  # loop thread (filled before it starts)
        self.inflight = 0  # loop thread only: requests handed to a pool, not yet sent

    def add(self, handlers: dict[MsgType, Handler]) -> None:
        check_handlers(handlers)
        for mtype, handler in handlers.items():
            if mtype in self.handlers:
                raise ValueError(f"{mtype} already has a handler")
            self.handlers[mtype] = handler

    def start(self) -> None:
        """Every pool thread now, not at the first request (`spawn_all`)."""
        spawn_all(self.normal, self._pool_sizes[0])
        spawn_all(self.transfer_pool, self._pool_sizes[1])

    def pools_alive(self) -> bool:
        """Both pools still accept work (False once they were shut down)."""
        return not self._shut.is_set()

    def shutdown(self) -> None:
        self._shut.set()
        self.normal.shutdown(wait=False, cancel_futures=True)
        self.transfer_pool.shutdown(wait=False, cancel_futures=True)

    def take_done(self) -> tuple[list[bytes], bytes] | None:
        """Loop thread: the next answer a pool finished, or None."""
        try:
            item = self.done.get_nowait()
        except queue.Empty:
            return None
        self.inflight -= 1
        return item

    def route(
        self, envelope: list[bytes], req: Request, fd: int, handler: Handler | None, send: SendFrame
    ) -> None:
        """Loop thread: run ``req`` where its row says; ``send`` answers on the loop thread."""
        if handler is None:
            send(
                envelope,
                encode_error(req.request_id, Unsupported(f"{req.type} has no handler on this server")),
            )
            return
        spec = SPECS[req.type]
        rctx = RequestContext(req.request_id, req.type, fd)
        key = handler.order_key(req.payload) if handler.order_key is not None else None
        if spec.kind is HandlerKind.LOOP:
            send(envelope, self.call(handler, rctx, req.payload))
            _after(rctx)
            return
        if self._inline(handler, req.payload, key):
            inline = RequestContext(req.request_id, req.type, fd, inline=True)
            with contextlib.suppress(Deferred):  # it would wait after all: on to the pool
                send(envelope, self.call(handler, inline, req.payload))
                _after(inline)
                return
        self.inflight += 1

        def task() -> None:
            self.done.put((envelope, self.call(handler, rctx, req.payload)))
            self._wake()
            _after(rctx)

        if key is not None:
            self._transfer.submit(key, task)
        else:
            self.normal.submit(task)

    def _inline(self, handler: Handler, payload: Any, key: int | None) -> bool:
        """A TRANSFER request the loop answers itself (`Handler.inline`): in order, since no
        earlier one with its key waits or runs."""
        if handler.inline is None or key is None or self._transfer.busy(key):
            return False
        return handler.inline(payload)

    def call(self, handler: Handler, rctx: RequestContext, payload: Any) -> bytes:
        """Run a handler; its reply frame, or the error reply its failure maps to."""
        t0 = time.perf_counter()
        try:
            result = handler.fn(rctx, payload)
            if type(result) is not SPECS[rctx.type].reply:
                raise TypeError(f"returned {type(result).__name__}, not {SPECS[rctx.type].reply.__name__}")
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


def _after(rctx: RequestContext) -> None:
    """What the handler left to run once its reply is on its way (`RequestContext.after`)."""
    for fn in rctx.after:
        try:
            fn()
        except Exception:  # its failure is not the request's: the reply is gone
            logger.exception("server: work after a %s reply failed", rctx.type)
