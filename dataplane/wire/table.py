"""The protocol as one table: for every message type, its request record, the reply record that
answers it, where the server runs it, and the bounds it keeps beyond its fields' checks.

Everything else is derived from this table: the server's dispatch (`dataplane.server.dispatch`
runs each request where its row says, and refuses a handler that returns another reply type),
the request parsers (`PARSERS`), the client's reply decoding (`decode_body`: typed records,
never maps) and docs/protocol.md's message tables (scripts/gen_protocol_doc.py; `make lint`
fails when the document disagrees). A module supplies only the functions (`Handler`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from dataplane.wire import messages as m
from dataplane.wire import replies as r
from dataplane.wire.errors import ProtocolError
from dataplane.wire.kinds import MsgType
from dataplane.wire.records import Message, Reply, decode_record, decode_reply_map


class HandlerKind(enum.Enum):
    LOOP = "loop"  # cheap and non-blocking: runs on the socket loop itself
    NORMAL = "normal"  # control and metadata: the NORMAL pool
    TRANSFER = "transfer"  # copies: the transfer pool, one instance's requests in arrival order


LOOP, NORMAL, TRANSFER = HandlerKind.LOOP, HandlerKind.NORMAL, HandlerKind.TRANSFER


@dataclass(frozen=True, slots=True)
class Spec:
    """One message type's row."""

    request: type[Message[Any]]
    reply: type[Reply]
    kind: HandlerKind
    # TRANSFER: the loop answers it itself when the module says it will not wait and no earlier
    # request of its instance is queued or running (`Handler.inline`)
    inline: bool = False
    limits: str = ""  # bounds beyond the fields' own checks

    @property
    def type(self) -> MsgType:
        return self.request.TYPE


_CHUNKS = f"at most {m.MAX_POOL_CHUNKS} chunks"
_POOL = "n_chunks at most the pool's slots; the chunks named are full chunks of token_ids"
_LEASES = "16 open leases per instance"
_BLOCKS = "block_ids cover every full chunk, each < num_blocks"
_INSTANCES = "--max-instances, --max-instances-per-connection"
_ROPE = "rotary_dim even <= head_dim; max_positions <= 131072"

TABLE: tuple[Spec, ...] = (
    Spec(m.Hello, r.ServerHello, LOOP),
    Spec(m.GetServerInfo, r.ServerHello, LOOP),
    Spec(m.Ping, r.PingReply, LOOP),
    Spec(m.Register, r.Registered, NORMAL, limits=f"{_INSTANCES}, --max-mapped-gb"),
    Spec(m.Unregister, r.Unregistered, NORMAL),
    Spec(m.Store, r.StoreCounts, TRANSFER, limits=_BLOCKS),
    Spec(m.Retrieve, r.Retrieved, TRANSFER, limits=_BLOCKS),
    Spec(m.Lookup, r.Hits, NORMAL),
    Spec(m.LookupScope, r.ScopeHits, NORMAL),
    Spec(m.LookupWaited, r.Noted, LOOP),
    Spec(m.PrefetchScope, r.Noted, NORMAL),
    Spec(m.ClearScope, r.Cleared, NORMAL, limits="answered once every tier is cleared (the disk, Redis)"),
    Spec(m.EngineRegister, r.PoolRegistered, NORMAL, limits=f"a 4 GiB pool; --max-pool-gb; {_INSTANCES}"),
    Spec(m.EngineStore, r.StoreCounts, TRANSFER, limits=_POOL),
    Spec(m.EngineRetrieve, r.PoolRetrieved, TRANSFER, limits=_POOL),
    Spec(m.EngineReserve, r.Reserved, TRANSFER, inline=True, limits=_LEASES),
    Spec(m.EngineCommit, r.Committed, LOOP),
    Spec(m.EngineAcquire, r.Acquired, TRANSFER, inline=True, limits=_LEASES),
    Spec(m.EngineRelease, r.Released, LOOP),
    Spec(m.BlendRegister, r.BlendRegistered, NORMAL, limits=_ROPE),
    Spec(m.BlendStore, r.StoreCounts, TRANSFER, limits="chunks below max_positions"),
    Spec(m.BlendRetrieve, r.BlendRetrieved, TRANSFER, limits="chunks below max_positions"),
    Spec(m.BlendReserve, r.Reserved, TRANSFER, limits=f"{_CHUNKS}; {_LEASES}"),
    Spec(m.BlendAcquire, r.BlendAcquired, TRANSFER, limits=f"{_CHUNKS}; {_LEASES}"),
)

SPECS: dict[MsgType, Spec] = {s.type: s for s in TABLE}
MESSAGES: tuple[type[Message[Any]], ...] = tuple(s.request for s in TABLE)
BY_TYPE: dict[MsgType, type[Message[Any]]] = {s.type: s.request for s in TABLE}


def _declared_reply(cls: type) -> Any:
    """The reply type a request record names as its type parameter."""
    for base in getattr(cls, "__orig_bases__", ()):
        args = get_args(base)
        if args and isinstance(args[0], type) and issubclass(args[0], Reply):
            return args[0]
    return None


def _check_table() -> None:
    if len(SPECS) != len(TABLE) or set(SPECS) != set(MsgType):
        raise AssertionError("every message type has exactly one row")
    for s in TABLE:
        if _declared_reply(s.request) is not s.reply:
            raise AssertionError(f"{s.type}: the row's reply is not the one its record declares")
        if s.inline and s.kind is not TRANSFER:
            raise AssertionError(f"{s.type}: only TRANSFER requests are answered inline")


_check_table()


# ------------------------------------------------------------------ derived: parse, decode


def _parser(cls: type[Message[Any]]) -> Callable[[Any], Message[Any]]:
    return lambda v: decode_record(cls, v, cls.TYPE.value)


PARSERS: dict[MsgType, Callable[[Any], Message[Any]]] = {s.type: _parser(s.request) for s in TABLE}


def decode_body(mtype: MsgType, body: Any) -> Reply:
    """The typed reply to a request of ``mtype`` (ProtocolError naming the field otherwise)."""
    return decode_reply_map(SPECS[mtype].reply, body, f"{mtype.value} reply")


def decode_error(body: Any) -> r.ErrorReply:
    """An error reply's body; one that does not check is reported as what it is."""
    try:
        return decode_reply_map(r.ErrorReply, body, "error reply")
    except ProtocolError as exc:
        return r.ErrorReply("INTERNAL", f"malformed error reply ({exc})")
