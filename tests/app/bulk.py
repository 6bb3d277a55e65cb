"""Many tracked instances, cheaply: REGISTER frames of one worker's cache under fresh ids."""

from __future__ import annotations

import dataclasses
import itertools
import uuid
from typing import Any

import zmq

from dataplane.client import WorkerAdapter
from dataplane.wire.protocol import decode_reply, encode_message

_WINDOW = 256  # requests in flight at once


def register_many(endpoint: str, template: WorkerAdapter, n: int, timeout_s: float = 60.0) -> list[int]:
    """Register ``n`` more instances mapping ``template``'s (registered) cache; their ids."""
    reg = template.registration
    assert reg is not None, "the template adapter must be registered"
    ids = [uuid.uuid4().int & ((1 << 63) - 1) for _ in range(n)]
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    rids = itertools.count(1)
    try:
        pending = 0
        it = iter(ids)
        done = 0
        while done < n:
            for iid in it:
                sock.send(encode_message(next(rids), dataclasses.replace(reg, instance_id=iid)))
                pending += 1
                if pending >= _WINDOW:
                    break
            if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise AssertionError(f"no REGISTER reply within {timeout_s:g}s ({done}/{n})")
            reply = decode_reply(sock.recv())
            assert reply.ok and reply.body["created"], reply
            pending -= 1
            done += 1
    finally:
        sock.close(linger=0)
        ctx.term()
    return ids
