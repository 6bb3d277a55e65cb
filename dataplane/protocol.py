"""The kvwarden wire protocol: msgpack frames, versioned, typed and validated at the edge.

Request  = msgpack ``[version, request_id, type, payload]``  (payload: a msgpack array)
Reply    = msgpack ``[version, request_id, ok, body]``
           ``body`` is the result when ``ok`` is true, else ``{"code": str, "message": str}``.

A DEALER client sends one frame per request; a REQ client's empty delimiter frame is accepted too.
Nothing on the wire is pickled: token and block ids travel as little-endian int32 arrays in
msgpack ``bin`` fields, everything else as msgpack scalars, arrays and maps.
See docs/protocol.md for every message.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import numpy as np

from dataplane.errors import FrameTooLarge, KVWardenError, ProtocolError, VersionMismatch

PROTOCOL_VERSION = 1
INT64_MAX = (1 << 63) - 1
U63_LIMIT = 1 << 63
U64_LIMIT = 1 << 64
DEFAULT_MAX_FRAME_BYTES = 16 << 20
MAX_TOKENS_PER_REQUEST = 1 << 21
MAX_LAYERS = 1024
MAX_NAME_LEN = 256
ID_DTYPE = np.dtype("<i4")
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")


class MsgType(enum.StrEnum):
    HELLO = "HELLO"
    GET_SERVER_INFO = "GET_SERVER_INFO"
    PING = "PING"
    REGISTER_KV_CACHE = "REGISTER_KV_CACHE"
    UNREGISTER_KV_CACHE = "UNREGISTER_KV_CACHE"
    STORE = "STORE"
    RETRIEVE = "RETRIEVE"
    LOOKUP = "LOOKUP"
    ENGINE_REGISTER = "ENGINE_REGISTER"
    ENGINE_STORE = "ENGINE_STORE"
    ENGINE_RETRIEVE = "ENGINE_RETRIEVE"


class MemoryKind(enum.StrEnum):
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"


# ---------------------------------------------------------------------------------- payloads


@dataclass(frozen=True, slots=True)
class Empty:
    pass


@dataclass(frozen=True, slots=True)
class Ping:
    instance_id: int | None


@dataclass(frozen=True, slots=True)
class InstanceOnly:
    instance_id: int


@dataclass(frozen=True, slots=True)
class ShmLayer:
    segment: str
    offset: int  # bytes from the start of the segment
    strides: tuple[int, ...]  # in elements


@dataclass(frozen=True, slots=True)
class CudaLayer:
    device_uuid: str
    device_index: int
    ipc_handle: bytes
    storage_nbytes: int
    storage_offset: int  # bytes of the storage inside its IPC allocation
    tensor_offset: int  # bytes of the layer inside its storage
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    strides: tuple[int, ...]  # in elements


@dataclass(frozen=True, slots=True)
class Register:
    instance_id: int
    model_name: str
    world_size: int
    worker_id: int
    transfer_mode: str
    memory: MemoryKind
    dtype: str
    kv_shape: tuple[int, int, int, int, int]  # [2, num_blocks, block_size, heads, head_dim]
    owner_pid: int  # informational: shown to operators
    layers: tuple[ShmLayer | CudaLayer, ...]


@dataclass(frozen=True, slots=True)
class Transfer:
    """STORE and RETRIEVE: token i lives in block ``block_ids[i // block_size]``."""

    instance_id: int
    token_ids: np.ndarray
    block_ids: np.ndarray


@dataclass(frozen=True, slots=True)
class Lookup:
    instance_id: int
    token_ids: np.ndarray


@dataclass(frozen=True, slots=True)
class EngineRegister:
    """Engine-driven: the worker keeps ordinary tensors; the server hands out a chunk pool."""

    instance_id: int
    model_name: str
    world_size: int
    worker_id: int
    dtype: str
    num_layers: int
    heads: int
    head_dim: int
    pool_chunks: int
    owner_pid: int


@dataclass(frozen=True, slots=True)
class EngineTransfer:
    """ENGINE_STORE: pool slot i holds chunk ``first_chunk + i`` (``n_chunks`` of them).
    ENGINE_RETRIEVE: fill up to ``n_chunks`` slots from chunk ``first_chunk`` on."""

    instance_id: int
    token_ids: np.ndarray
    first_chunk: int
    n_chunks: int


MAX_POOL_CHUNKS = 64

Payload = (
    Empty | Ping | InstanceOnly | Register | Transfer | Lookup | EngineRegister | EngineTransfer
)


# -------------------------------------------------------------------------------- validators

Check = Callable[[Any, str], Any]


def _tname(v: Any) -> str:
    return type(v).__name__


def u63(v: Any, where: str) -> int:
    if type(v) is not int:
        raise ProtocolError(f"{where}: expected an integer, got {_tname(v)}")
    if not 0 <= v < U63_LIMIT:
        raise ProtocolError(f"{where}: {v} is out of range [0, 2^63)")
    return v


def opt_u63(v: Any, where: str) -> int | None:
    return None if v is None else u63(v, where)


def small_int(lo: int, hi: int) -> Check:
    def check(v: Any, where: str) -> int:
        if type(v) is not int:
            raise ProtocolError(f"{where}: expected an integer, got {_tname(v)}")
        if not lo <= v <= hi:
            raise ProtocolError(f"{where}: {v} is out of range [{lo}, {hi}]")
        return v

    return check


def name(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"{where}: expected a string, got {_tname(v)}")
    if not 0 < len(v) <= MAX_NAME_LEN:
        raise ProtocolError(f"{where}: length {len(v)} is outside [1, {MAX_NAME_LEN}]")
    return v


def blob(max_len: int) -> Check:
    def check(v: Any, where: str) -> bytes:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{where}: expected bytes, got {_tname(v)}")
        if len(v) > max_len:
            raise ProtocolError(f"{where}: {len(v)} bytes exceeds the limit of {max_len}")
        return v

    return check


def boolean(v: Any, where: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{where}: expected a boolean, got {_tname(v)}")
    return v


def one_of(choices: Sequence[str]) -> Check:
    def check(v: Any, where: str) -> str:
        if v not in choices or not isinstance(v, str):
            raise ProtocolError(f"{where}: {v!r} is not one of {', '.join(choices)}")
        return v

    return check


def int_list(length: int, lo: int, hi: int) -> Check:
    item = small_int(lo, hi)

    def check(v: Any, where: str) -> tuple[int, ...]:
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected an array, got {_tname(v)}")
        if len(v) != length:
            raise ProtocolError(f"{where}: expected {length} items, got {len(v)}")
        return tuple(item(x, f"{where}[{i}]") for i, x in enumerate(v))

    return check


def id_array(max_count: int, *, allow_empty: bool = True) -> Check:
    def check(v: Any, where: str) -> np.ndarray:
        if not isinstance(v, bytes):
            raise ProtocolError(f"{where}: expected bytes (little-endian int32 array), got {_tname(v)}")
        if len(v) % 4:
            raise ProtocolError(f"{where}: {len(v)} bytes is not a whole number of int32 ids")
        n = len(v) // 4
        if n > max_count:
            raise ProtocolError(f"{where}: {n} ids exceeds the limit of {max_count}")
        if n == 0 and not allow_empty:
            raise ProtocolError(f"{where}: must not be empty")
        return np.frombuffer(v, dtype=ID_DTYPE)

    return check


def fields(msg: str, spec: Sequence[tuple[str, Check]], v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ProtocolError(f"{msg}: payload must be an array, got {_tname(v)}")
    if len(v) != len(spec):
        names = ", ".join(n for n, _ in spec) or "nothing"
        raise ProtocolError(f"{msg}: expected {len(spec)} payload fields ({names}), got {len(v)}")
    return [check(x, f"{msg}.{fname}") for (fname, check), x in zip(spec, v, strict=True)]


_STRIDES = int_list(5, 0, INT64_MAX)
_SHM_LAYER = (("segment", name), ("offset", small_int(0, INT64_MAX)), ("strides", _STRIDES))
_CUDA_LAYER = (
    ("device_uuid", name),
    ("device_index", small_int(0, 1024)),
    ("ipc_handle", blob(1024)),
    ("storage_nbytes", small_int(0, INT64_MAX)),
    ("storage_offset", small_int(0, INT64_MAX)),
    ("tensor_offset", small_int(0, INT64_MAX)),
    ("ref_counter_handle", blob(1024)),
    ("ref_counter_offset", small_int(0, INT64_MAX)),
    ("event_handle", blob(1024)),
    ("event_sync_required", boolean),
    ("strides", _STRIDES),
)


def _layers(memory: str) -> Check:
    def check(v: Any, where: str) -> tuple[ShmLayer | CudaLayer, ...]:
        if not isinstance(v, list):
            raise ProtocolError(f"{where}: expected an array, got {_tname(v)}")
        if not 0 < len(v) <= MAX_LAYERS:
            raise ProtocolError(f"{where}: {len(v)} layers is outside [1, {MAX_LAYERS}]")
        out: list[ShmLayer | CudaLayer] = []
        for i, layer in enumerate(v):
            if memory == MemoryKind.SHM:
                out.append(ShmLayer(*fields(f"{where}[{i}]", _SHM_LAYER, layer)))
            else:
                out.append(CudaLayer(*fields(f"{where}[{i}]", _CUDA_LAYER, layer)))
        return tuple(out)

    return check


R = TypeVar("R", Register, EngineRegister)


def _rank_ok(reg: R, msg: str) -> R:
    if reg.worker_id >= reg.world_size:
        raise ProtocolError(f"{msg}.worker_id: {reg.worker_id} must be < world_size {reg.world_size}")
    return reg


def _parse_register(v: Any) -> Register:
    head = (
        ("instance_id", u63),
        ("model_name", name),
        ("world_size", small_int(1, 1 << 20)),
        ("worker_id", small_int(0, 1 << 20)),
        ("transfer_mode", one_of(("server_driven",))),
        ("memory", one_of(tuple(MemoryKind))),
        ("dtype", one_of(SUPPORTED_DTYPES)),
        ("kv_shape", int_list(5, 1, 1 << 31)),
        ("owner_pid", small_int(0, 1 << 31)),
        ("layers", lambda x, w: x),
    )
    vals = fields("REGISTER_KV_CACHE", head, v)
    memory = MemoryKind(vals[5])
    vals[5] = memory
    vals[9] = _layers(memory)(vals[9], "REGISTER_KV_CACHE.layers")
    reg = _rank_ok(Register(*vals), "REGISTER_KV_CACHE")
    if reg.kv_shape[0] != 2:
        raise ProtocolError(f"REGISTER_KV_CACHE.kv_shape[0]: must be 2 (K and V), got {reg.kv_shape[0]}")
    return reg


_TOKENS = id_array(MAX_TOKENS_PER_REQUEST)
_BLOCKS = id_array(MAX_TOKENS_PER_REQUEST)
_ENGINE_XFER = (
    ("instance_id", u63),
    ("token_ids", _TOKENS),
    ("first_chunk", small_int(0, MAX_TOKENS_PER_REQUEST)),
    ("n_chunks", small_int(0, 64)),
)

PARSERS: dict[MsgType, Callable[[Any], Payload]] = {
    MsgType.HELLO: lambda v: Empty(*fields("HELLO", (), v)),
    MsgType.GET_SERVER_INFO: lambda v: Empty(*fields("GET_SERVER_INFO", (), v)),
    MsgType.PING: lambda v: Ping(*fields("PING", (("instance_id", opt_u63),), v)),
    MsgType.REGISTER_KV_CACHE: _parse_register,
    MsgType.UNREGISTER_KV_CACHE: lambda v: InstanceOnly(
        *fields("UNREGISTER_KV_CACHE", (("instance_id", u63),), v)
    ),
    MsgType.STORE: lambda v: Transfer(
        *fields("STORE", (("instance_id", u63), ("token_ids", _TOKENS), ("block_ids", _BLOCKS)), v)
    ),
    MsgType.RETRIEVE: lambda v: Transfer(
        *fields("RETRIEVE", (("instance_id", u63), ("token_ids", _TOKENS), ("block_ids", _BLOCKS)), v)
    ),
    MsgType.LOOKUP: lambda v: Lookup(*fields("LOOKUP", (("instance_id", u63), ("token_ids", _TOKENS)), v)),
    MsgType.ENGINE_REGISTER: lambda v: _rank_ok(EngineRegister(*fields("ENGINE_REGISTER", (
        ("instance_id", u63),
        ("model_name", name),
        ("world_size", small_int(1, 1 << 20)),
        ("worker_id", small_int(0, 1 << 20)),
        ("dtype", one_of(SUPPORTED_DTYPES)),
        ("num_layers", small_int(1, MAX_LAYERS)),
        ("heads", small_int(1, 1 << 16)),
        ("head_dim", small_int(1, 1 << 16)),
        ("pool_chunks", small_int(1, MAX_POOL_CHUNKS)),
        ("owner_pid", small_int(0, 1 << 31)),
    ), v)), "ENGINE_REGISTER"),
    MsgType.ENGINE_STORE: lambda v: EngineTransfer(*fields("ENGINE_STORE", _ENGINE_XFER, v)),
    MsgType.ENGINE_RETRIEVE: lambda v: EngineTransfer(*fields("ENGINE_RETRIEVE", _ENGINE_XFER, v)),
}


# ------------------------------------------------------------------------------- framing


@dataclass(frozen=True, slots=True)
class Request:
    request_id: int
    type: MsgType
    payload: Payload


def peek_request_id(raw: Any) -> int:
    """Best-effort request id of a frame that failed to decode (0 when there is none)."""
    if isinstance(raw, list) and len(raw) >= 2 and type(raw[1]) is int and 0 <= raw[1] < U64_LIMIT:
        return int(raw[1])
    return 0


def unpack(data: bytes | memoryview, max_frame_bytes: int) -> Any:
    if len(data) > max_frame_bytes:
        raise FrameTooLarge(f"frame of {len(data)} bytes exceeds the limit of {max_frame_bytes} bytes")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(f"undecodable frame ({type(exc).__name__}: {exc})") from None


def decode_request(raw: Any) -> Request:
    """Validate a decoded frame: version first, then id, type and typed payload."""
    if not isinstance(raw, list) or len(raw) != 4:
        n = len(raw) if isinstance(raw, list) else _tname(raw)
        raise ProtocolError(f"request must be [version, request_id, type, payload], got {n} items")
    version, request_id, mtype, payload = raw
    if type(version) is not int:
        raise ProtocolError(f"request.version: expected an integer, got {_tname(version)}")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: client speaks v{version}, server speaks v{PROTOCOL_VERSION}"
        )
    if type(request_id) is not int or not 0 <= request_id < U64_LIMIT:
        raise ProtocolError("request.request_id: expected an integer in [0, 2^64)")
    if not isinstance(mtype, str):
        raise ProtocolError(f"request.type: expected a string, got {_tname(mtype)}")
    try:
        msg = MsgType(mtype)
    except ValueError:
        raise ProtocolError(
            f"request.type: unknown message type {mtype[:64]!r}; known: {', '.join(MsgType)}"
        ) from None
    return Request(request_id, msg, PARSERS[msg](payload))


def encode_request(request_id: int, mtype: MsgType | str, payload: list[Any],
                   version: int = PROTOCOL_VERSION) -> bytes:
    data: bytes = msgpack.packb([version, request_id, str(mtype), payload], use_bin_type=True)
    return data


def encode_ok(request_id: int, body: Any) -> bytes:
    data: bytes = msgpack.packb([PROTOCOL_VERSION, request_id, True, body], use_bin_type=True)
    return data


def encode_error(request_id: int, err: KVWardenError | str, message: str | None = None) -> bytes:
    if isinstance(err, KVWardenError):
        code, text = err.code, str(err)
    else:
        code, text = err, message or ""
    data: bytes = msgpack.packb(
        [PROTOCOL_VERSION, request_id, False, {"code": code, "message": text}], use_bin_type=True
    )
    return data


@dataclass(frozen=True, slots=True)
class Reply:
    request_id: int
    ok: bool
    body: Any


def decode_reply(data: bytes) -> Reply:
    raw = msgpack.unpackb(data, raw=False)
    if not isinstance(raw, list) or len(raw) != 4:
        raise ProtocolError("malformed reply")
    version, request_id, ok, body = raw
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"protocol version mismatch: server speaks v{version}, client speaks v{PROTOCOL_VERSION}"
        )
    return Reply(int(request_id), bool(ok), body)


def ids_to_bytes(ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(ids)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids must be integers, got {arr.dtype}")
    if arr.ndim > 1:
        raise ValueError(f"ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < -(1 << 31) or arr.max() >= (1 << 31)):
        raise ValueError("ids must fit in int32")
    return arr.astype(ID_DTYPE, copy=False).tobytes()


def finite(x: float) -> bool:
    return math.isfinite(x)
