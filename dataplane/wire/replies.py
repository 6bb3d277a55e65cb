"""Every reply's body, declared once, as a typed record.

A reply travels as a map of its fields (``reply_to_wire``); the client checks it against its
record as the server checks a request (``decode_reply_map``): exactly these fields, each passing
its check, or a `ProtocolError` naming the field. Which reply answers which request is declared
in `dataplane.wire.table`; docs/protocol.md's tables are generated from both.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from dataplane.wire.checks import (
    INT64_MAX,
    boolean,
    list_of,
    name,
    opt_boolean,
    pair,
    small_int,
    text,
    u63,
)
from dataplane.wire.records import Reply, opt_record_map

MAX_REPLY_CHUNKS = 1 << 21  # chunks one request can name (its tokens, a chunk of one token)
MAX_LEASE_CHUNKS = 64  # chunks of one lease (MAX_POOL_CHUNKS)
MAX_ERROR_CHARS = 1 << 16

_COUNT = small_int(0, MAX_REPLY_CHUNKS)
_TOKENS = small_int(0, 1 << 31)
_BYTES = small_int(0, INT64_MAX)
_CHUNK = small_int(0, MAX_REPLY_CHUNKS - 1)  # a chunk's index in the request


@dataclasses.dataclass(frozen=True, slots=True)
class ServerHello(Reply):
    server_id: Annotated[str, name, "random hex id of this server process"]
    boot_token: Annotated[int, u63, "random, new on every server start"]
    version: Annotated[str, name, "kvwarden package version"]
    protocol_version: Annotated[int, small_int(0, 1 << 16), "the server's protocol version"]
    chunk_size: Annotated[int, small_int(1, 1 << 21), "tokens per chunk"]
    max_frame_bytes: Annotated[int, _BYTES, "the request frame limit"]


@dataclasses.dataclass(frozen=True, slots=True)
class PingReply(Reply):
    boot_token: Annotated[int, u63, "the server's boot token: a change means the server restarted"]
    tracked: Annotated[bool | None, opt_boolean, "whether the id is registered here; nil for a probe"]


@dataclasses.dataclass(frozen=True, slots=True)
class Unregistered(Reply):
    removed: Annotated[bool, boolean, "the instance was registered and its state is freed"]


@dataclasses.dataclass(frozen=True, slots=True)
class Registered(Reply):
    created: Annotated[bool, boolean, "false for a repeat registration with the same fields"]
    chunk_size: Annotated[int, small_int(1, 1 << 21), "tokens per chunk"]


@dataclasses.dataclass(frozen=True, slots=True)
class StoreCounts(Reply):
    """What a store did with each full chunk of the request: each one is stored, present,
    rejected or skipped."""

    chunks: Annotated[int, _COUNT, "full chunks the request names"]
    stored: Annotated[int, _COUNT, "chunks written by this request"]
    present: Annotated[int, _COUNT, "chunks the server already held"]
    rejected: Annotated[int, _COUNT, "chunks not stored: L1 holds nothing it may evict"]
    skipped: Annotated[int, _COUNT, "chunks not stored: the server is unhealthy and writes nothing"]

    @property
    def complete(self) -> bool:
        """Every chunk is held by the server afterwards."""
        return self.rejected == 0 and self.skipped == 0

    def plus(self, stored: int = 0, present: int = 0, rejected: int = 0, skipped: int = 0) -> StoreCounts:
        """These counts with more of each (a store sent in rounds)."""
        return StoreCounts(
            self.chunks,
            self.stored + stored,
            self.present + present,
            self.rejected + rejected,
            self.skipped + skipped,
        )

    def plus_round(self, r: StoreCounts) -> StoreCounts:
        return self.plus(r.stored, r.present, r.rejected, r.skipped)


NO_STORE = StoreCounts(0, 0, 0, 0, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class Retrieved(Reply):
    retrieved_tokens: Annotated[int, _TOKENS, "prefix tokens written into the worker's blocks"]


@dataclasses.dataclass(frozen=True, slots=True)
class Hits(Reply):
    hit_tokens: Annotated[int, _TOKENS, "prefix tokens held, a multiple of the chunk size"]
    pending_tokens: Annotated[
        int, _TOKENS, "prefix tokens after those being stored now (reserved or written, not yet committed)"
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class ScopeHits(Reply):
    hit_tokens: Annotated[int, _TOKENS, "prefix tokens every rank holds"]
    chunk_size: Annotated[int, small_int(1, 1 << 21), "tokens per chunk"]
    pending_tokens: Annotated[
        int, _TOKENS, "prefix tokens after those that every rank holds or is storing now (not yet committed)"
    ]
    l1_tokens: Annotated[
        int, _TOKENS, "of hit_tokens, the prefix every rank holds in L1 now (the rest is on disk or in Redis)"
    ]
    fs_tokens: Annotated[
        int, _TOKENS, "of hit_tokens, those after l1_tokens that every rank's file tier holds (then: Redis)"
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaInfo(Reply):
    segment: Annotated[str, name, "L1's arena segment under /dev/shm"]
    bytes: Annotated[int, _BYTES, "its size"]
    usable: Annotated[int, _BYTES, "bytes of it usable now (the rest is still being reserved)"]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolRegistered(Reply):
    created: Annotated[bool, boolean, "false for a repeat registration with the same fields"]
    chunk_size: Annotated[int, small_int(1, 1 << 21), "tokens per chunk"]
    segment: Annotated[str, name, "the pool's segment under /dev/shm, for the worker to map"]
    slot_bytes: Annotated[int, _BYTES, "bytes of one slot: one chunk"]
    slots: Annotated[int, small_int(1, MAX_LEASE_CHUNKS), "slot i starts at byte i * slot_bytes"]
    arena: Annotated[
        ArenaInfo | None,
        opt_record_map(ArenaInfo),
        "L1's arena when it is a shared-memory segment (one-copy transfers), else nil",
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolRetrieved(Reply):
    chunks: Annotated[int, small_int(0, MAX_LEASE_CHUNKS), "slots 0 .. chunks-1 hold the prefix found"]


@dataclasses.dataclass(frozen=True, slots=True)
class Reserved(Reply):
    lease: Annotated[int, u63, "finished by ENGINE_COMMIT, or it expires"]
    slots: Annotated[
        tuple[tuple[int, int], ...],
        list_of(pair(_CHUNK, _BYTES), MAX_LEASE_CHUNKS),
        "[chunk, arena offset] of each chunk to write",
    ]
    slot_bytes: Annotated[int, _BYTES, "bytes of one chunk"]
    present: Annotated[int, _COUNT, "chunks the server already held"]
    rejected: Annotated[int, _COUNT, "chunks not handed out: L1 holds nothing it may evict"]
    skipped: Annotated[int, _COUNT, "chunks not handed out: the server is unhealthy"]
    chunks: Annotated[int, _COUNT, "chunks the request names"]
    usable: Annotated[int, _BYTES, "arena bytes usable now"]


@dataclasses.dataclass(frozen=True, slots=True)
class Cleared(Reply):
    l1: Annotated[int, u63, "chunks dropped from L1"]
    fs: Annotated[int, u63, "chunk files removed from the file tier"]
    remote: Annotated[int, u63, "chunks removed from the remote tier"]
    pinned: Annotated[int, u63, "L1 chunks a reader still held at the deadline: they stay"]
    failed: Annotated[tuple[str, ...], list_of(name, 4), "tiers that could not be cleared (down, an error)"]
    complete: Annotated[bool, boolean, "nothing of the scope is left: no tier failed, nothing pinned"]


@dataclasses.dataclass(frozen=True, slots=True)
class Noted(Reply):
    counted: Annotated[bool, boolean, "taken: a report counted in /metrics, a prefetch started"]


@dataclasses.dataclass(frozen=True, slots=True)
class Committed(Reply):
    stored: Annotated[int, _COUNT, "chunks published"]


@dataclasses.dataclass(frozen=True, slots=True)
class Acquired(Reply):
    lease: Annotated[int, u63, "finished by ENGINE_RELEASE, or it expires"]
    offsets: Annotated[
        tuple[int, ...], list_of(_BYTES, MAX_LEASE_CHUNKS), "arena offset of each chunk of the held prefix"
    ]
    slot_bytes: Annotated[int, _BYTES, "bytes of one chunk"]
    usable: Annotated[int, _BYTES, "arena bytes usable now"]


@dataclasses.dataclass(frozen=True, slots=True)
class BlendAcquired(Reply):
    lease: Annotated[int, u63, "finished by ENGINE_RELEASE, or it expires"]
    chunks: Annotated[
        tuple[tuple[int, int], ...],
        list_of(pair(_CHUNK, small_int(-1, INT64_MAX)), MAX_LEASE_CHUNKS),
        "[chunk, arena offset] of every full chunk; offset -1: not held",
    ]
    slot_bytes: Annotated[int, _BYTES, "bytes of one chunk"]
    usable: Annotated[int, _BYTES, "arena bytes usable now"]


@dataclasses.dataclass(frozen=True, slots=True)
class Released(Reply):
    released: Annotated[bool, boolean, "always true"]


@dataclasses.dataclass(frozen=True, slots=True)
class BlendRegistered(Reply):
    table_bytes: Annotated[int, _BYTES, "bytes of the RoPE tables the server keeps for the instance"]


@dataclasses.dataclass(frozen=True, slots=True)
class BlendRetrieved(Reply):
    chunks: Annotated[
        tuple[tuple[int, bool], ...],
        list_of(pair(_CHUNK, boolean), MAX_REPLY_CHUNKS),
        "[chunk, hit] of every full chunk",
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class ErrorReply(Reply):
    """The body of every reply whose ``ok`` is false."""

    code: Annotated[str, name, "the error's code (docs/protocol.md, Errors)"]
    message: Annotated[str, text(MAX_ERROR_CHARS), "what went wrong, naming the field or the limit"]
