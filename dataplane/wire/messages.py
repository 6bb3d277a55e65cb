"""Every message's payload, declared once, as a typed record.

A record's fields, in declaration order, are its payload's positional fields, and each field's
annotation carries the check that validates it at the edge (``Annotated[int, u63]``). The
parser of every message type (`PARSERS`) and the encoder (`encode_payload`) are derived from
these declarations: nothing outside `dataplane.wire` knows a field's position. Rules that span
fields (a rank below the world size, layers of the kind ``memory`` names) live in a record's
``_checked`` hook. docs/protocol.md describes every message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np

from dataplane.wire.checks import (
    INT64_MAX,
    array_of,
    blob,
    boolean,
    id_array,
    int_list,
    member_of,
    name,
    number,
    one_of,
    opt_u63,
    small_int,
    type_name,
    u63,
)
from dataplane.wire.context import KeyContext as KeyContext
from dataplane.wire.context import opt_key_context
from dataplane.wire.errors import ProtocolError
from dataplane.wire.kinds import KVFormat as KVFormat
from dataplane.wire.kinds import MemoryKind as MemoryKind
from dataplane.wire.kinds import MsgType as MsgType
from dataplane.wire.kinds import TransferMode as TransferMode
from dataplane.wire.records import Message as Message
from dataplane.wire.records import Record as Record
from dataplane.wire.records import RecT as RecT
from dataplane.wire.records import decode_record as decode_record
from dataplane.wire.records import encode_payload as encode_payload
from dataplane.wire.records import field_checks as field_checks
from dataplane.wire.records import field_names as field_names

MAX_TOKENS_PER_REQUEST = 1 << 21
MAX_LAYERS = 1024
MAX_POOL_CHUNKS = 64  # chunk slots of one engine-driven pool
MAX_RANKS = 1 << 20
MAX_BLOCK_SIZE = 1 << 16
MAX_SCOPE_RANKS = 64  # ranks one LOOKUP_SCOPE checks
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


# ------------------------------------------------------------------------------- records

_IDS = id_array(MAX_TOKENS_PER_REQUEST)
_RANKS = small_int(1, MAX_RANKS)
_RANK = small_int(0, MAX_RANKS)
_PID = small_int(0, 1 << 31)
_STRIDES = int_list(5, 0, INT64_MAX)
_OFFSET = small_int(0, INT64_MAX)
_HANDLE = blob(1024)
SECRET_BYTES = (16, 64)  # an instance's secret: random bytes only its registrant knows


def _secret(v: Any, where: str) -> bytes:
    lo, hi = SECRET_BYTES
    if not isinstance(v, bytes):
        raise ProtocolError(f"{where}: expected bytes, got {type_name(v)}")
    if not lo <= len(v) <= hi:
        raise ProtocolError(f"{where}: {len(v)} bytes is outside [{lo}, {hi}]")
    return v


def _opt_secret(v: Any, where: str) -> bytes | None:
    return None if v is None else _secret(v, where)


def _rank_below_world(where: str, worker_id: int, world_size: int) -> None:
    if worker_id >= world_size:
        raise ProtocolError(f"{where}.worker_id: {worker_id} must be < world_size {world_size}")


@dataclasses.dataclass(frozen=True, slots=True)
class Hello(Message):
    TYPE = MsgType.HELLO


@dataclasses.dataclass(frozen=True, slots=True)
class GetServerInfo(Message):
    TYPE = MsgType.GET_SERVER_INFO


@dataclasses.dataclass(frozen=True, slots=True)
class Ping(Message):
    """``instance_id`` None: a probe that touches nothing. With an id, ``secret`` must be the
    one the instance registered with, else the PING touches nothing and answers untracked."""

    TYPE = MsgType.PING
    instance_id: Annotated[int | None, opt_u63]
    secret: Annotated[bytes | None, _opt_secret]  # None with a probe

    def _checked(self, where: str) -> Ping:
        if (self.instance_id is None) != (self.secret is None):
            raise ProtocolError(f"{where}.secret: must be given with an instance_id, and only then")
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class ShmLayer(Record):
    segment: Annotated[str, name]
    offset: Annotated[int, _OFFSET]  # bytes from the start of the segment
    strides: Annotated[tuple[int, ...], _STRIDES]  # in elements


@dataclasses.dataclass(frozen=True, slots=True)
class CudaLayer(Record):
    device_uuid: Annotated[str, name]
    device_index: Annotated[int, small_int(0, 1024)]
    ipc_handle: Annotated[bytes, _HANDLE]
    storage_nbytes: Annotated[int, _OFFSET]
    storage_offset: Annotated[int, _OFFSET]  # bytes of the storage inside its IPC allocation
    tensor_offset: Annotated[int, _OFFSET]  # bytes of the layer inside its storage
    ref_counter_handle: Annotated[bytes, _HANDLE]
    ref_counter_offset: Annotated[int, _OFFSET]
    event_handle: Annotated[bytes, _HANDLE]
    event_sync_required: Annotated[bool, boolean]
    strides: Annotated[tuple[int, ...], _STRIDES]  # in elements


Layer = ShmLayer | CudaLayer


@dataclasses.dataclass(frozen=True, slots=True)
class Register(Message):
    TYPE = MsgType.REGISTER_KV_CACHE
    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    model_name: Annotated[str, name]
    world_size: Annotated[int, _RANKS]
    worker_id: Annotated[int, _RANK]
    transfer_mode: Annotated[TransferMode, member_of(TransferMode, [TransferMode.SERVER_DRIVEN])]
    memory: Annotated[MemoryKind, member_of(MemoryKind)]
    dtype: Annotated[str, one_of(SUPPORTED_DTYPES)]
    kv_shape: Annotated[tuple[int, ...], int_list(5, 1, 1 << 31)]  # [2, blocks, block, heads, dim]
    owner_pid: Annotated[int, _PID]  # informational: shown to operators
    layers: Annotated[tuple[Layer, ...], array_of(1, MAX_LAYERS, "layers")]

    def _checked(self, where: str) -> Register:
        _rank_below_world(where, self.worker_id, self.world_size)
        if self.kv_shape[0] != 2:
            raise ProtocolError(f"{where}.kv_shape[0]: must be 2 (K and V), got {self.kv_shape[0]}")
        kind: type[Record] = ShmLayer if self.memory is MemoryKind.SHM else CudaLayer
        layers = tuple(decode_record(kind, raw, f"{where}.layers[{i}]") for i, raw in enumerate(self.layers))
        return dataclasses.replace(self, layers=layers)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class Unregister(Message):
    TYPE = MsgType.UNREGISTER_KV_CACHE
    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer(Message):
    """STORE and RETRIEVE: token i lives in block ``block_ids[i // block_size]``."""

    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    token_ids: Annotated[np.ndarray, _IDS]
    block_ids: Annotated[np.ndarray, _IDS]
    key: Annotated[KeyContext | None, opt_key_context] = None  # salt, adapter, ...: context.py


@dataclasses.dataclass(frozen=True, slots=True)
class Store(Transfer):
    TYPE = MsgType.STORE


@dataclasses.dataclass(frozen=True, slots=True)
class Retrieve(Transfer):
    TYPE = MsgType.RETRIEVE


@dataclasses.dataclass(frozen=True, slots=True)
class Lookup(Message):
    TYPE = MsgType.LOOKUP
    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    token_ids: Annotated[np.ndarray, _IDS]
    key: Annotated[KeyContext | None, opt_key_context] = None  # salt, adapter, ...: context.py


@dataclasses.dataclass(frozen=True, slots=True)
class LookupScope(Message):
    """LOOKUP for a process that holds no KV memory (an engine's scheduler): the scope is named
    by what a worker's ENGINE_REGISTER would carry, for every rank of ``world_size``; the answer
    is the prefix every rank holds."""

    TYPE = MsgType.LOOKUP_SCOPE
    model_name: Annotated[str, name]
    world_size: Annotated[int, small_int(1, MAX_SCOPE_RANKS)]
    dtype: Annotated[str, one_of(SUPPORTED_DTYPES)]
    num_layers: Annotated[int, small_int(1, MAX_LAYERS)]
    heads: Annotated[int, small_int(1, 1 << 16)]
    head_dim: Annotated[int, small_int(1, 1 << 16)]
    kv_format: Annotated[KVFormat, member_of(KVFormat)]
    block_size: Annotated[int, small_int(1, MAX_BLOCK_SIZE)]
    token_ids: Annotated[np.ndarray, _IDS]
    key: Annotated[KeyContext | None, opt_key_context] = None  # salt, adapter, ...: context.py


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRegister(Message):
    """Engine-driven: the worker keeps ordinary tensors; the server hands out a chunk pool."""

    TYPE = MsgType.ENGINE_REGISTER
    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    model_name: Annotated[str, name]
    world_size: Annotated[int, _RANKS]
    worker_id: Annotated[int, _RANK]
    dtype: Annotated[str, one_of(SUPPORTED_DTYPES)]
    num_layers: Annotated[int, small_int(1, MAX_LAYERS)]
    heads: Annotated[int, small_int(1, 1 << 16)]
    head_dim: Annotated[int, small_int(1, 1 << 16)]
    pool_chunks: Annotated[int, small_int(1, MAX_POOL_CHUNKS)]
    owner_pid: Annotated[int, _PID]
    kv_format: Annotated[KVFormat, member_of(KVFormat)]
    block_size: Annotated[int, small_int(1, MAX_BLOCK_SIZE)]  # tokens per block of the engine

    def _checked(self, where: str) -> EngineRegister:
        _rank_below_world(where, self.worker_id, self.world_size)
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class EngineTransfer(Message):
    """ENGINE_STORE: pool slot i holds chunk ``first_chunk + i`` (``n_chunks`` of them).
    ENGINE_RETRIEVE: fill up to ``n_chunks`` slots from chunk ``first_chunk`` on."""

    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    token_ids: Annotated[np.ndarray, _IDS]
    first_chunk: Annotated[int, small_int(0, MAX_TOKENS_PER_REQUEST)]
    n_chunks: Annotated[int, small_int(0, MAX_POOL_CHUNKS)]
    key: Annotated[KeyContext | None, opt_key_context] = None  # salt, adapter, ...: context.py


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStore(EngineTransfer):
    TYPE = MsgType.ENGINE_STORE


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRetrieve(EngineTransfer):
    TYPE = MsgType.ENGINE_RETRIEVE


@dataclasses.dataclass(frozen=True, slots=True)
class EngineReserve(EngineTransfer):
    """One copy, STORE: L1 buffers for the chunks ``first_chunk ..`` not yet held, handed out
    (offsets in the L1 arena) for the worker to write, under a lease it then commits."""

    TYPE = MsgType.ENGINE_RESERVE


@dataclasses.dataclass(frozen=True, slots=True)
class EngineAcquire(EngineTransfer):
    """One copy, RETRIEVE: the held prefix of the chunks ``first_chunk ..``, pinned under a
    lease while the worker copies out of the arena."""

    TYPE = MsgType.ENGINE_ACQUIRE


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLease(Message):
    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    lease: Annotated[int, u63]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineCommit(EngineLease):
    """Publish the chunks written into a reserve's buffers."""

    TYPE = MsgType.ENGINE_COMMIT


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRelease(EngineLease):
    """Let go of an acquire's pins (the worker copied out)."""

    TYPE = MsgType.ENGINE_RELEASE


@dataclasses.dataclass(frozen=True, slots=True)
class BlendRegister(Message):
    """A worker's RoPE parameters, for blend transfers (checked by the blend module, which
    names a bad one: rotary_dim even and <= head_dim, base and scaling finite and > 0, ...)."""

    TYPE = MsgType.BLEND_REGISTER
    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    rotary_dim: Annotated[int, small_int(0, 1 << 16)]
    base: Annotated[float, number]
    style: Annotated[str, name]
    scaling: Annotated[float, number]
    max_positions: Annotated[int, small_int(0, INT64_MAX)]


@dataclasses.dataclass(frozen=True, slots=True)
class BlendTransfer(Message):
    """Chunks independent of what precedes them: chunk i of ``token_ids`` is at ``position +
    i * chunk_size`` in the worker's sequence (``block_ids`` as for STORE)."""

    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    token_ids: Annotated[np.ndarray, _IDS]
    block_ids: Annotated[np.ndarray, _IDS]
    position: Annotated[int, small_int(0, 1 << 31)]
    key: Annotated[KeyContext | None, opt_key_context] = None  # salt, adapter, ...: context.py


@dataclasses.dataclass(frozen=True, slots=True)
class BlendStore(BlendTransfer):
    TYPE = MsgType.BLEND_STORE


@dataclasses.dataclass(frozen=True, slots=True)
class BlendRetrieve(BlendTransfer):
    TYPE = MsgType.BLEND_RETRIEVE


@dataclasses.dataclass(frozen=True, slots=True)
class BlendLease(Message):
    """One copy, engine-driven, the worker rotating: each full chunk of ``token_ids`` on its own
    (at most MAX_POOL_CHUNKS); finished by ENGINE_COMMIT / ENGINE_RELEASE of the lease."""

    instance_id: Annotated[int, u63]
    secret: Annotated[bytes, _secret]
    token_ids: Annotated[np.ndarray, _IDS]
    key: Annotated[KeyContext | None, opt_key_context] = None  # salt, adapter, ...: context.py


@dataclasses.dataclass(frozen=True, slots=True)
class BlendReserve(BlendLease):
    TYPE = MsgType.BLEND_RESERVE  # L1 buffers for the chunks not held


@dataclasses.dataclass(frozen=True, slots=True)
class BlendAcquire(BlendLease):
    TYPE = MsgType.BLEND_ACQUIRE  # the held chunks pinned, their offsets


MESSAGES: tuple[type[Message], ...] = (
    Hello,
    GetServerInfo,
    Ping,
    Register,
    Unregister,
    Store,
    Retrieve,
    Lookup,
    LookupScope,
    EngineRegister,
    EngineStore,
    EngineRetrieve,
    EngineReserve,
    EngineCommit,
    EngineAcquire,
    EngineRelease,
    BlendRegister,
    BlendStore,
    BlendRetrieve,
    BlendReserve,
    BlendAcquire,
)
BY_TYPE: dict[MsgType, type[Message]] = {m.TYPE: m for m in MESSAGES}
assert set(BY_TYPE) == set(MsgType), "every message type has exactly one record"


# ------------------------------------------------------------------ derived: parse, encode


def _parser(cls: type[Message]) -> Callable[[Any], Message]:
    return lambda v: decode_record(cls, v, cls.TYPE.value)


PARSERS: dict[MsgType, Callable[[Any], Message]] = {t: _parser(c) for t, c in BY_TYPE.items()}
