"""Requests as they travel, for the wire unit tests: valid payloads of every kind, with one
field replaced at a time, and the decoding the server does at its edge."""

from __future__ import annotations

from typing import Any

import numpy as np

from dataplane.wire import checks as c
from dataplane.wire import messages as m
from dataplane.wire import protocol as p
from dataplane.wire.table import PARSERS
from tests.dataplane.registration import SECRET, engine_register_message

IID = 123456789
V = p.PROTOCOL_VERSION
NO_IDS = np.zeros(0, dtype=c.ID_DTYPE)


def raw(version: Any, rid: Any, mtype: Any, payload: Any) -> list[Any]:
    return [version, rid, mtype, payload]


def decode(mtype: str, payload: Any, rid: int = 7) -> p.Request:
    return p.decode_request(raw(p.PROTOCOL_VERSION, rid, mtype, payload))


def roundtrip(frame: bytes, limit: int = p.DEFAULT_MAX_FRAME_BYTES) -> p.Request:
    return p.decode_request(p.unpack(frame, limit))


def payload_of(msg: m.Record, **over: Any) -> list[Any]:
    """``msg``'s payload as it travels, the named fields replaced by raw (wire) values."""
    out = m.encode_payload(msg)
    names = m.field_names(type(msg))
    for field, value in over.items():
        out[names.index(field)] = value
    return out


def in_wire_order(cls: type[m.Record], vals: dict[str, Any]) -> list[Any]:
    assert set(vals) == set(m.field_names(cls)), set(vals) ^ set(m.field_names(cls))
    return [vals[n] for n in m.field_names(cls)]


def shm_register(**over: Any) -> list[Any]:
    vals: dict[str, Any] = {
        "instance_id": IID,
        "secret": SECRET,
        "model_name": "m",
        "world_size": 2,
        "worker_id": 1,
        "transfer_mode": "server_driven",
        "memory": "shm",
        "dtype": "bfloat16",
        "kv_shape": [2, 64, 16, 2, 8],
        "owner_pid": 4242,
        "layers": [
            ["kvwarden-1-0123456789abcdef", 0, [16384, 256, 16, 8, 1]],
            ["kvwarden-1-0123456789abcdef", 32768, [16384, 256, 16, 8, 1]],
        ],
    }
    vals.update(over)
    return in_wire_order(m.Register, vals)


def cuda_layer(**over: Any) -> list[Any]:
    vals: dict[str, Any] = {
        "device_uuid": "GPU-1234",
        "device_index": 0,
        "ipc_handle": b"h" * 64,
        "storage_nbytes": 1 << 20,
        "storage_offset": 0,
        "tensor_offset": 0,
        "ref_counter_handle": b"r" * 16,
        "ref_counter_offset": 0,
        "event_handle": b"e" * 64,
        "event_sync_required": True,
        "strides": [16384, 256, 16, 8, 1],
    }
    vals.update(over)
    return in_wire_order(m.CudaLayer, vals)


def instance_messages() -> list[m.Message]:
    """One valid message of every type that names an instance (all carry its secret)."""
    tok = np.arange(2 * 16)
    return [
        m.Ping(IID, SECRET),
        PARSERS[m.MsgType.REGISTER_KV_CACHE](shm_register()),
        m.Unregister(IID, SECRET),
        m.Store(IID, SECRET, tok, np.array([3, 1])),
        m.Retrieve(IID, SECRET, tok, np.array([3, 1])),
        m.Lookup(IID, SECRET, tok),
        engine_register_message(IID),
        m.EngineStore(IID, SECRET, tok, 0, 2),
        m.EngineRetrieve(IID, SECRET, tok, 0, 2),
        m.BlendStore(IID, SECRET, tok, np.array([3, 1]), 16),
        m.BlendReserve(IID, SECRET, tok),
        m.BlendAcquire(IID, SECRET, tok),
    ]


INSTANCE_MESSAGES = instance_messages()
