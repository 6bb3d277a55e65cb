"""Every message's payload, declared once, as a typed record.

A record's fields, in declaration order, are its payload's positional fields, and each field's
annotation carries the check that validates it at the edge (``Annotated[int, u63]``). A
record's type parameter is the reply that answers it (`dataplane.wire.replies`); its handling
is declared in `dataplane.wire.table`, whose parsers and encoders are derived from these
declarations: nothing outside `dataplane.wire` knows a field's position. Rules that span
fields live in a record's ``_checked`` hook. docs/protocol.md is generated from them.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import numpy as np

from dataplane.wire.blocks import MAX_BLOCK_SIZE, EngineBlocksField
from dataplane.wire.blocks import EngineBlocks as EngineBlocks
from dataplane.wire.checks import (
    INT64_MAX,
    array_of,
    id_array,
    int_list,
    member_of,
    name,
    number,
    one_of,
    opt_small_int,
    opt_u63,
    seconds,
    small_int,
    type_name,
    u63,
    wire_type,
)
from dataplane.wire.context import KeyContext as KeyContext
from dataplane.wire.context import opt_key_context
from dataplane.wire.errors import ProtocolError
from dataplane.wire.kinds import KVFormat as KVFormat
from dataplane.wire.kinds import MemoryKind as MemoryKind
from dataplane.wire.kinds import MsgType as MsgType
from dataplane.wire.kinds import TransferMode as TransferMode
from dataplane.wire.layers import CudaLayer as CudaLayer
from dataplane.wire.layers import ShmLayer as ShmLayer
from dataplane.wire.records import Message as Message
from dataplane.wire.records import Record as Record
from dataplane.wire.records import RecT as RecT
from dataplane.wire.records import RepT
from dataplane.wire.records import decode_record as decode_record
from dataplane.wire.records import encode_payload as encode_payload
from dataplane.wire.records import field_checks as field_checks
from dataplane.wire.records import field_names as field_names
from dataplane.wire.replies import (
    Acquired,
    BlendAcquired,
    BlendRegistered,
    BlendRetrieved,
    Cleared,
    Committed,
    Hits,
    Noted,
    PingReply,
    PoolRegistered,
    PoolRetrieved,
    Registered,
    Released,
    Reserved,
    Retrieved,
    ScopeHits,
    ServerHello,
    StoreCounts,
    Unregistered,
)

MAX_TOKENS_PER_REQUEST = 1 << 21
MAX_LAYERS = 1024
MAX_POOL_CHUNKS = 64  # chunk slots of one engine-driven pool
MAX_RANKS = 1 << 20
MAX_SCOPE_RANKS = 64  # ranks one LOOKUP_SCOPE checks
MAX_WINDOW_CHUNKS = 1 << 16  # the chunks a LOOKUP_SCOPE window may name
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
# what a worker's chunks are stored as: its KV as is, or quantized to int8 (`dataplane.memory.int8`)
KV_CODECS = ("none", "int8")
_KV_CODEC = "`none`: the KV as the engine holds it; `int8`: quantized (lossy); part of the scope"

Layer = ShmLayer | CudaLayer

# ------------------------------------------------------------------------------- records

_IDS = id_array(MAX_TOKENS_PER_REQUEST)
_RANKS = small_int(1, MAX_RANKS)
_RANK = small_int(0, MAX_RANKS)
_PID = small_int(0, 1 << 31)
SECRET_BYTES = (16, 64)  # an instance's secret: random bytes only its registrant knows


@wire_type("secret: bin of 16 to 64 bytes")
def _secret(v: Any, where: str) -> bytes:
    lo, hi = SECRET_BYTES
    if not isinstance(v, bytes):
        raise ProtocolError(f"{where}: expected bytes, got {type_name(v)}")
    if not lo <= len(v) <= hi:
        raise ProtocolError(f"{where}: {len(v)} bytes is outside [{lo}, {hi}]")
    return v


@wire_type("secret or nil")
def _opt_secret(v: Any, where: str) -> bytes | None:
    return None if v is None else _secret(v, where)


def _rank_below_world(where: str, worker_id: int, world_size: int) -> None:
    if worker_id >= world_size:
        raise ProtocolError(f"{where}.worker_id: {worker_id} must be < world_size {world_size}")


@dataclasses.dataclass(frozen=True, slots=True)
class Hello(Message[ServerHello]):
    TYPE = MsgType.HELLO


@dataclasses.dataclass(frozen=True, slots=True)
class GetServerInfo(Message[ServerHello]):
    TYPE = MsgType.GET_SERVER_INFO


@dataclasses.dataclass(frozen=True, slots=True)
class Ping(Message[PingReply]):
    """``instance_id`` None: a probe that touches nothing. With an id, ``secret`` must be the
    one the instance registered with, else the PING touches nothing and answers untracked."""

    TYPE = MsgType.PING
    instance_id: Annotated[
        int | None, opt_u63, "the worker whose liveness this is; nil: a probe that touches nothing"
    ]
    secret: Annotated[bytes | None, _opt_secret, "the instance's secret; nil with a probe"]

    def _checked(self, where: str) -> Ping:
        if (self.instance_id is None) != (self.secret is None):
            raise ProtocolError(f"{where}.secret: must be given with an instance_id, and only then")
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class Register(Message[Registered]):
    TYPE = MsgType.REGISTER_KV_CACHE
    instance_id: Annotated[int, u63, "the worker's id: uuid4().int & (2^63 - 1), never a PID"]
    secret: Annotated[bytes, _secret, "the instance's secret: random bytes only its registrant knows"]
    model_name: Annotated[str, name, "part of the chunk keys' scope"]
    world_size: Annotated[int, _RANKS, "tensor-parallel ranks"]
    worker_id: Annotated[int, _RANK, "this rank, < world_size"]
    transfer_mode: Annotated[
        TransferMode,
        member_of(TransferMode, [TransferMode.SERVER_DRIVEN]),
        "the server maps the memory and copies",
    ]
    memory: Annotated[MemoryKind, member_of(MemoryKind), "what every layer descriptor is"]
    dtype: Annotated[str, one_of(SUPPORTED_DTYPES), "the KV tensors' element type"]
    kv_shape: Annotated[
        tuple[int, ...], int_list(5, 1, 1 << 31), "[2, num_blocks, block_size, num_kv_heads, head_dim]"
    ]
    owner_pid: Annotated[int, _PID, "informational: shown to operators"]
    layers: Annotated[
        tuple[Layer, ...],
        array_of(1, MAX_LAYERS, "layers"),
        "one descriptor per layer, all of the kind `memory` names (`ShmLayer`, `CudaLayer`)",
    ]

    def _checked(self, where: str) -> Register:
        _rank_below_world(where, self.worker_id, self.world_size)
        if self.kv_shape[0] != 2:
            raise ProtocolError(f"{where}.kv_shape[0]: must be 2 (K and V), got {self.kv_shape[0]}")
        kind: type[Record] = ShmLayer if self.memory is MemoryKind.SHM else CudaLayer
        layers = tuple(decode_record(kind, raw, f"{where}.layers[{i}]") for i, raw in enumerate(self.layers))
        return dataclasses.replace(self, layers=layers)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class Unregister(Message[Unregistered]):
    TYPE = MsgType.UNREGISTER_KV_CACHE
    instance_id: Annotated[int, u63, "the instance to free"]
    secret: Annotated[bytes, _secret, "the instance's secret"]


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer(Message[RepT]):
    """STORE and RETRIEVE: token i lives in block ``block_ids[i // block_size]``."""

    instance_id: Annotated[int, u63, "a registered instance"]
    secret: Annotated[bytes, _secret, "the instance's secret"]
    token_ids: Annotated[np.ndarray, _IDS, "the prompt; its full chunks are stored or retrieved"]
    block_ids: Annotated[np.ndarray, _IDS, "token i lives in block block_ids[i // block_size]"]
    key: Annotated[
        KeyContext | None, opt_key_context, "what the KV depends on beyond the tokens (`KeyContext`), or nil"
    ] = None


@dataclasses.dataclass(frozen=True, slots=True)
class Store(Transfer[StoreCounts]):
    TYPE = MsgType.STORE
    blocks: EngineBlocksField = None


@dataclasses.dataclass(frozen=True, slots=True)
class Retrieve(Transfer[Retrieved]):
    TYPE = MsgType.RETRIEVE


@dataclasses.dataclass(frozen=True, slots=True)
class Lookup(Message[Hits]):
    TYPE = MsgType.LOOKUP
    instance_id: Annotated[int, u63, "a registered instance (either transfer mode)"]
    secret: Annotated[bytes, _secret, "the instance's secret"]
    token_ids: Annotated[np.ndarray, _IDS, "the prompt"]
    key: Annotated[KeyContext | None, opt_key_context, "as for STORE"] = None


@dataclasses.dataclass(frozen=True, slots=True)
class ScopeName(Record):
    """A scope named by what a worker's ENGINE_REGISTER would carry, for every rank of
    ``world_size`` (what CLEAR_SCOPE carries; LOOKUP_SCOPE and PREFETCH_SCOPE add a prompt)."""

    model_name: Annotated[str, name, "as its workers register"]
    world_size: Annotated[int, small_int(1, MAX_SCOPE_RANKS), "ranks 0 .. world_size-1 are checked"]
    dtype: Annotated[str, one_of(SUPPORTED_DTYPES), "as for REGISTER_KV_CACHE"]
    num_layers: Annotated[int, small_int(1, MAX_LAYERS), "layers of the model"]
    heads: Annotated[int, small_int(1, 1 << 16), "KV heads"]
    head_dim: Annotated[int, small_int(1, 1 << 16)]
    kv_format: Annotated[KVFormat, member_of(KVFormat), "as for ENGINE_REGISTER"]
    block_size: Annotated[int, small_int(1, MAX_BLOCK_SIZE), "as for ENGINE_REGISTER"]


@dataclasses.dataclass(frozen=True, slots=True)
class ScopeRequest(ScopeName):
    """What LOOKUP_SCOPE and PREFETCH_SCOPE carry: a scope (`ScopeName`) and a prompt."""

    token_ids: Annotated[np.ndarray, _IDS, "the prompt"]
    key: Annotated[KeyContext | None, opt_key_context, "as for STORE"] = None
    window: Annotated[
        int,
        small_int(0, MAX_WINDOW_CHUNKS),
        "0: the prefix's every chunk is needed; w > 0: its last w (a sliding-window layer group)",
    ] = 0
    kv_codec: Annotated[str, one_of(KV_CODECS), "as for ENGINE_REGISTER"] = "none"


@dataclasses.dataclass(frozen=True, slots=True)
class LookupScope(ScopeRequest, Message[ScopeHits]):
    """LOOKUP for a process that holds no KV memory (an engine's scheduler): the answer is the
    prefix every rank of the scope holds."""

    TYPE = MsgType.LOOKUP_SCOPE


@dataclasses.dataclass(frozen=True, slots=True)
class PrefetchScope(ScopeRequest, Message[Noted]):
    """LOOKUP_SCOPE's read-ahead without its answer: a scheduler just given a request asks the
    server to start bringing the request's prefix from its slower tiers (the file tier, Redis)
    into L1, so it is there by the time the request is scheduled and asks LOOKUP_SCOPE. Counts
    no lookup."""

    TYPE = MsgType.PREFETCH_SCOPE


@dataclasses.dataclass(frozen=True, slots=True)
class ClearScope(ScopeName, Message[Cleared]):
    """Remove every chunk of the scope, every rank's, from every tier (the engine's reset of
    its cache: its weights changed, so what it stored is stale); answered once done."""

    TYPE = MsgType.CLEAR_SCOPE
    kv_codec: Annotated[str, one_of(KV_CODECS), "as for ENGINE_REGISTER"] = "none"


WAIT_OUTCOMES = ("hit", "partial", "gave_up")
MAX_WAIT_S = 3600.0


@dataclasses.dataclass(frozen=True, slots=True)
class LookupWaited(Message[Noted]):
    """A scheduler held a request back while chunks of its prefix were being stored, and how
    that ended: counted in /metrics (the server never sees the wait itself: the scheduler asks
    again on later steps)."""

    TYPE = MsgType.LOOKUP_WAITED
    waited_s: Annotated[
        float, seconds(MAX_WAIT_S), "from the first LOOKUP that saw chunks in flight to the last"
    ]
    outcome: Annotated[
        str,
        one_of(WAIT_OUTCOMES),
        "hit: every chunk waited for landed; partial: some did; gave_up: the bound passed first",
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRegister(Message[PoolRegistered]):
    """Engine-driven: the worker keeps ordinary tensors; the server hands out a chunk pool."""

    TYPE = MsgType.ENGINE_REGISTER
    instance_id: Annotated[int, u63, "as for REGISTER_KV_CACHE"]
    secret: Annotated[bytes, _secret, "as for REGISTER_KV_CACHE"]
    model_name: Annotated[str, name, "part of the chunk keys' scope"]
    world_size: Annotated[int, _RANKS, "tensor-parallel ranks"]
    worker_id: Annotated[int, _RANK, "this rank, < world_size"]
    dtype: Annotated[str, one_of(SUPPORTED_DTYPES), "as for REGISTER_KV_CACHE"]
    num_layers: Annotated[int, small_int(1, MAX_LAYERS), "layers of the model"]
    heads: Annotated[int, small_int(1, 1 << 16), "KV heads"]
    head_dim: Annotated[int, small_int(1, 1 << 16)]
    pool_chunks: Annotated[int, small_int(1, MAX_POOL_CHUNKS), "chunk slots of the pool the server creates"]
    owner_pid: Annotated[int, _PID, "informational"]
    kv_format: Annotated[KVFormat, member_of(KVFormat), "what a chunk's bytes are (part of the scope)"]
    block_size: Annotated[int, small_int(1, MAX_BLOCK_SIZE), "tokens per block of the engine's paged memory"]
    kv_codec: Annotated[str, one_of(KV_CODECS), _KV_CODEC] = "none"

    def _checked(self, where: str) -> EngineRegister:
        _rank_below_world(where, self.worker_id, self.world_size)
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class EngineTransfer(Message[RepT]):
    """ENGINE_STORE: pool slot i holds chunk ``first_chunk + i`` (``n_chunks`` of them).
    ENGINE_RETRIEVE: fill up to ``n_chunks`` slots from chunk ``first_chunk`` on."""

    instance_id: Annotated[int, u63, "an engine-driven instance"]
    secret: Annotated[bytes, _secret, "the instance's secret"]
    token_ids: Annotated[
        np.ndarray, _IDS, "gives the chunks their keys (up to the last chunk named is enough)"
    ]
    first_chunk: Annotated[int, small_int(0, MAX_TOKENS_PER_REQUEST), "the first chunk named"]
    n_chunks: Annotated[int, small_int(0, MAX_POOL_CHUNKS), "chunks named from first_chunk on"]
    key: Annotated[KeyContext | None, opt_key_context, "as for STORE"] = None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStore(EngineTransfer[StoreCounts]):
    TYPE = MsgType.ENGINE_STORE
    blocks: EngineBlocksField = None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRetrieve(EngineTransfer[PoolRetrieved]):
    TYPE = MsgType.ENGINE_RETRIEVE


@dataclasses.dataclass(frozen=True, slots=True)
class EngineReserve(EngineTransfer[Reserved]):
    """One copy, STORE: L1 buffers for the chunks ``first_chunk ..`` not yet held, handed out
    (offsets in the L1 arena) for the worker to write, under a lease it then commits."""

    TYPE = MsgType.ENGINE_RESERVE
    blocks: EngineBlocksField = None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineAcquire(EngineTransfer[Acquired]):
    """One copy, RETRIEVE: the held prefix of the chunks ``first_chunk ..``, pinned under a
    lease while the worker copies out of the arena."""

    TYPE = MsgType.ENGINE_ACQUIRE


@dataclasses.dataclass(frozen=True, slots=True)
class EngineLease(Message[RepT]):
    instance_id: Annotated[int, u63, "the instance the lease belongs to"]
    secret: Annotated[bytes, _secret, "the instance's secret"]
    lease: Annotated[int, u63, "from its ENGINE_RESERVE, ENGINE_ACQUIRE, BLEND_RESERVE or BLEND_ACQUIRE"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineCommit(EngineLease[Committed]):
    """Publish the chunks written into a reserve's buffers: all, closing the lease, or the next
    ``count`` of them, keeping it open, so a long store becomes visible as it lands."""

    TYPE = MsgType.ENGINE_COMMIT
    count: Annotated[int | None, opt_small_int(1, MAX_POOL_CHUNKS), "nil: all left; n: the next n"] = None


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRelease(EngineLease[Released]):
    """Let go of an acquire's pins (the worker copied out)."""

    TYPE = MsgType.ENGINE_RELEASE


@dataclasses.dataclass(frozen=True, slots=True)
class BlendRegister(Message[BlendRegistered]):
    """A worker's RoPE parameters, for blend transfers (checked by the blend module, which
    names a bad one: rotary_dim even and <= head_dim, base and scaling finite and > 0, ...)."""

    TYPE = MsgType.BLEND_REGISTER
    instance_id: Annotated[int, u63, "a registered instance"]
    secret: Annotated[bytes, _secret, "the instance's secret"]
    rotary_dim: Annotated[int, small_int(0, 1 << 16), "even, at most head_dim"]
    base: Annotated[float, number, "RoPE base, finite and > 0"]
    style: Annotated[str, name, "`neox` or `interleaved`"]
    scaling: Annotated[float, number, "position scaling, finite and > 0"]
    max_positions: Annotated[int, small_int(0, INT64_MAX), "in [1, 131072]"]


@dataclasses.dataclass(frozen=True, slots=True)
class BlendTransfer(Message[RepT]):
    """Chunks independent of what precedes them: chunk i of ``token_ids`` is at ``position +
    i * chunk_size`` in the worker's sequence (``block_ids`` as for STORE)."""

    instance_id: Annotated[int, u63, "a registered instance"]
    secret: Annotated[bytes, _secret, "the instance's secret"]
    token_ids: Annotated[np.ndarray, _IDS, "chunks keyed on their own tokens, not the prefix"]
    block_ids: Annotated[np.ndarray, _IDS, "as for STORE (empty: the engine-driven pool)"]
    position: Annotated[int, small_int(0, 1 << 31), "chunk i is at position + i * chunk_size"]
    key: Annotated[KeyContext | None, opt_key_context, "as for STORE"] = None


@dataclasses.dataclass(frozen=True, slots=True)
class BlendStore(BlendTransfer[StoreCounts]):
    TYPE = MsgType.BLEND_STORE


@dataclasses.dataclass(frozen=True, slots=True)
class BlendRetrieve(BlendTransfer[BlendRetrieved]):
    TYPE = MsgType.BLEND_RETRIEVE


@dataclasses.dataclass(frozen=True, slots=True)
class BlendLease(Message[RepT]):
    """One copy, engine-driven, the worker rotating: each full chunk of ``token_ids`` on its own
    (at most MAX_POOL_CHUNKS); finished by ENGINE_COMMIT / ENGINE_RELEASE of the lease."""

    instance_id: Annotated[int, u63, "an engine-driven instance"]
    secret: Annotated[bytes, _secret, "the instance's secret"]
    token_ids: Annotated[np.ndarray, _IDS, "each full chunk on its own"]
    key: Annotated[KeyContext | None, opt_key_context, "as for STORE"] = None


@dataclasses.dataclass(frozen=True, slots=True)
class BlendReserve(BlendLease[Reserved]):
    TYPE = MsgType.BLEND_RESERVE  # L1 buffers for the chunks not held


@dataclasses.dataclass(frozen=True, slots=True)
class BlendAcquire(BlendLease[BlendAcquired]):
    TYPE = MsgType.BLEND_ACQUIRE  # the held chunks pinned, their offsets
