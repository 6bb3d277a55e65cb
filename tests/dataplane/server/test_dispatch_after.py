"""Work a handler leaves for after its reply (`RequestContext.after`): it runs once the reply
frame is queued for the loop to send, never before, and its failure is not the request's."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import pytest

from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.server.dispatch import Dispatcher
from dataplane.wire.messages import MsgType
from dataplane.wire.protocol import Request
from dataplane.wire.replies import Retrieved


def dispatcher() -> tuple[Dispatcher, threading.Event]:
    woken = threading.Event()
    d = Dispatcher(DataPlaneMetrics(), (1, 1), woken.set)
    d.start()
    return d, woken


def test_after_reply_work_runs_once_the_reply_is_queued(caplog: pytest.LogCaptureFixture) -> None:
    d, woken = dispatcher()
    seen: queue.SimpleQueue[tuple[str, bool]] = queue.SimpleQueue()

    def fn(rctx: RequestContext, payload: Any) -> Retrieved:
        rctx.after.append(lambda: seen.put(("first", woken.is_set() and not d.done.empty())))

        def boom() -> None:
            raise RuntimeError("late work failed")

        rctx.after.append(boom)
        rctx.after.append(lambda: seen.put(("last", True)))
        seen.put(("handler", woken.is_set()))
        return Retrieved(256)

    d.add({MsgType.RETRIEVE: Handler(fn, order_key=lambda p: 1)})
    sent: list[tuple[list[bytes], bytes]] = []
    try:
        with caplog.at_level(logging.ERROR, logger="dataplane.server.dispatch"):
            d.route(
                [b"peer"], Request(7, MsgType.RETRIEVE, None), 3, d.handlers[MsgType.RETRIEVE], sent.append
            )  # type: ignore[arg-type]
            got = [seen.get(timeout=10) for _ in range(3)]
        assert got == [
            ("handler", False),
            ("first", True),
            ("last", True),
        ]  # the hook after the reply, in order
        item = d.take_done()
        assert item is not None and item[0] == [b"peer"]  # the reply itself, unharmed
        assert "work after a RETRIEVE reply failed" in caplog.text
    finally:
        d.shutdown()
