"""A raw client of the bad-input tests: the server's settings they run against, the frames
they send and the checks on the replies (the fixtures are in conftest.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import zmq

from dataplane.client import WorkerAdapter
from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.messages import (
    EngineRegister,
    Lookup,
    Message,
    Ping,
    Record,
    Register,
    Store,
    Unregister,
    encode_payload,
    field_names,
)
from dataplane.wire.protocol import PROTOCOL_VERSION, ReplyFrame, encode_message, encode_request
from tests.dataplane.registration import SECRET
from tests.helpers import call, error_of, next_rid

MAX_FRAME = 65536
CHUNK = 32
LAYOUT = dict(num_layers=4, num_blocks=64, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
NO_IDS = np.zeros(0, dtype=ID_DTYPE)
# valid messages of instance 1 (never registered), for breaking one field at a time
PING1 = Ping(1, SECRET)
UNREG1 = Unregister(1, SECRET)
STORE1 = Store(1, SECRET, NO_IDS, NO_IDS)
LOOKUP1 = Lookup(1, SECRET, NO_IDS)

Sock = zmq.Socket[Any]


def expect_error(sock: Sock, frame: bytes | list[bytes], code: str, *parts: str) -> str:
    """The reply is an error with ``code`` whose message holds every part; PING still answers."""
    reply = call(sock, frame)
    got_code, message = error_of(reply)
    assert got_code == code, (got_code, message)
    for part in parts:
        assert part in message, (part, message)
    ping(sock)  # the server still answers, on the same connection
    return message


def frame(mtype: str, payload: Any, rid: int | None = None, version: int = PROTOCOL_VERSION) -> bytes:
    return encode_request(next_rid() if rid is None else rid, mtype, payload, version=version)


def ping(sock: Sock, instance_id: int | None = None, secret: bytes | None = None) -> ReplyFrame:
    """A PING (a probe without an id and secret) that must be answered, for this request."""
    rid = next_rid()
    reply = call(sock, encode_message(rid, Ping(instance_id, secret)))
    assert reply.ok, reply
    assert reply.request_id == rid
    assert isinstance(reply.body["boot_token"], int)
    return reply


def send(sock: Sock, msg: Message) -> ReplyFrame:
    return call(sock, encode_message(next_rid(), msg))


def payload_of(msg: Record, **over: Any) -> list[Any]:
    """``msg``'s payload as it travels, the named fields replaced by raw (wire) values."""
    out = encode_payload(msg)
    names = field_names(type(msg))
    for field, value in over.items():
        out[names.index(field)] = value
    return out


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, n).astype(ID_DTYPE)


def secret_of(w: WorkerAdapter) -> bytes:
    """The secret the adapter registered with (its REGISTER carries it)."""
    reg = w.registration
    assert isinstance(reg, Register | EngineRegister), reg
    return reg.secret


def registration(w: WorkerAdapter) -> Register:
    """The worker's own (valid) REGISTER, as the adapter sent it."""
    reg = w.registration
    assert isinstance(reg, Register), reg
    return reg
