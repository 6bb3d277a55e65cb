"""Many tracked instances, cheaply: one worker's tiny cache, registered again under fresh ids.

REGISTER frames of the template worker's registration with ``instance_id`` replaced are sent
over one DEALER socket, a window of them in flight. The socket stays open while the instances
are needed: the server reaps instances whose connection closed (after its disconnect grace).
"""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from typing import Any

import torch
import zmq

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.wire.messages import Ping
from dataplane.wire.protocol import decode_reply, encode_message

_WINDOW = 256  # requests in flight at once


class BulkRegistrar:
    """A registered template worker and a socket that registers more instances like it."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.worker = WorkerAdapter(endpoint, "bench-bulk", heartbeat_interval=10.0)
        self.worker.register_kv_caches(allocate_kv_caches(2, 8, 16, 2, 8, torch.bfloat16))
        reg = self.worker.registration
        assert reg is not None
        self.registration: Any = reg
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.rids = itertools.count(1)
        self.count = 1  # the template

    def ping_frame(self) -> bytes:
        """The template's own PING (it touches a tracked instance, as a heartbeat does)."""
        return encode_message(1, Ping(self.registration.instance_id, self.registration.secret))

    def grow_to(self, n: int) -> None:
        """Register instances until ``n`` are tracked through this registrar."""
        ids = [uuid.uuid4().int & ((1 << 63) - 1) for _ in range(max(0, n - self.count))]
        it = iter(ids)
        pending = done = 0
        while done < len(ids):
            for iid in it:
                msg = dataclasses.replace(self.registration, instance_id=iid)
                self.sock.send(encode_message(next(self.rids), msg))
                pending += 1
                if pending >= _WINDOW:
                    break
            if not self.sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                raise RuntimeError(f"no REGISTER reply within {self.timeout_s:g}s ({done}/{len(ids)})")
            reply = decode_reply(self.sock.recv())
            if not (reply.ok and reply.body.get("created")):
                raise RuntimeError(f"REGISTER refused: {reply.body}")
            pending -= 1
            done += 1
        self.count += len(ids)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        self.worker.close()
