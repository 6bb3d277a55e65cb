"""One DEALER socket to the server: requests in order, replies matched by request id."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from dataplane.wire.errors import RequestAborted, RequestTimeout, ServerClosed, error_from_reply
from dataplane.wire.messages import Message
from dataplane.wire.protocol import decode_reply, encode_message

ABORT_POLL_S = 0.1


class Channel:
    """One DEALER socket: requests in order, replies matched by request id."""

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue onto a dead connection
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.connect(endpoint)
        self.lock = threading.Lock()  # guards sock: one request at a time

    def request(self, msg: Message, timeout_s: float, abort: Callable[[], bool] | None = None) -> Any:
        """Send ``msg`` and wait for the reply. ``abort`` is checked every ``ABORT_POLL_S``
        while waiting: when it turns true the wait ends with ``RequestAborted``."""
        rid = next(self._ids)
        frame = encode_message(rid, msg)  # ValueError on ids that do not fit: nothing is sent
        mtype = msg.TYPE
        deadline = time.monotonic() + timeout_s
        with self.lock:
            sock = self.sock
            if sock.closed:
                raise ServerClosed("adapter is closed")
            try:  # the common case costs no poll: IMMEDIATE refuses only with no connection
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                if not sock.poll(int(timeout_s * 1000), zmq.POLLOUT):
                    raise RequestTimeout(
                        f"{mtype}: no connection to the server within {timeout_s:g}s"
                    ) from None
                sock.send(frame, zmq.NOBLOCK)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestTimeout(f"{mtype}: no reply within {timeout_s:g}s")
                step = left if abort is None else min(left, ABORT_POLL_S)
                sock.setsockopt(zmq.RCVTIMEO, max(1, int(step * 1000)))
                try:
                    data = sock.recv()
                except zmq.Again:
                    if abort is not None and abort():
                        raise RequestAborted(f"{mtype}: abandoned, the server is unhealthy") from None
                    continue
                reply = decode_reply(data)
                if reply.request_id != rid and not (reply.request_id == 0 and not reply.ok):
                    continue  # a late reply to an earlier, timed-out request
                # (id 0: the server could not read our id; one request is in flight: it is ours)
                if not reply.ok:
                    body = reply.body if isinstance(reply.body, dict) else {}
                    raise error_from_reply(str(body.get("code")), str(body.get("message")))
                return reply.body

    def close(self) -> None:
        with self.lock:
            self.sock.close(linger=0)
