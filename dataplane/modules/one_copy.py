"""One-copy engine-driven transfers: the worker writes into, and reads out of, L1's arena.

When L1's arena is a server-owned segment (`dataplane.storage.l1.arena`), ENGINE_REGISTER also
names it, and an engine-driven worker maps it. Then a STORE is ENGINE_RESERVE (the server pins
the prompt's chunks already held and hands out L1 buffers, as arena offsets, for the others)
followed by ENGINE_COMMIT (it publishes them); a RETRIEVE is ENGINE_ACQUIRE (it pins the held
prefix and hands out its offsets) followed by ENGINE_RELEASE. The bytes are copied once, by the
worker; no pool, no LOOKUP first. Between the two requests the buffers are the instance's
`Lease`s: whatever releases the instance aborts them (`dataplane.modules.leases`). Instances are
the engine-driven module's: this module keeps no state of its own.
"""

from __future__ import annotations

from typing import Any

from dataplane.events.describe import check_blocks, describe
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Deferred, Handler, RequestContext
from dataplane.modules.engine_pool import EngineContext, EngineDrivenTransferModule
from dataplane.modules.leases import Lease, reserve_into
from dataplane.storage.keys import chunk_keys, filing_scope
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.tenants import tenant_of
from dataplane.storage.tiered import TieredStore
from dataplane.wire.errors import RequestError
from dataplane.wire.messages import (
    EngineAcquire,
    EngineCommit,
    EngineRelease,
    EngineReserve,
    EngineTransfer,
    MsgType,
)
from dataplane.wire.replies import Acquired, Committed, Released, Reserved

_QUICK_CHUNKS = 64  # chunk keys a reserve or acquire on the loop thread may hash


class DirectTransferModule:
    name = "one_copy"

    def __init__(self, engine: EngineDrivenTransferModule, l1: L1Store, metrics: DataPlaneMetrics) -> None:
        self.engine = engine
        self.l1 = l1
        self.metrics = metrics

    def handlers(self) -> dict[MsgType, Handler]:
        key = self.engine.order_key  # in arrival order with the instance's other transfers
        return {
            # on the loop thread when they cannot wait (`_quick`), else in order on the pool
            MsgType.ENGINE_RESERVE: Handler(self._reserve, key, self._quick),
            # on the loop thread: they only publish or drop a lease's buffers under L1's and the
            # leases' locks (no copy, no wait); two thread hand-offs less per transfer
            MsgType.ENGINE_COMMIT: Handler(self._commit),
            MsgType.ENGINE_ACQUIRE: Handler(self._acquire, key, self._quick),
            MsgType.ENGINE_RELEASE: Handler(self._release),
        }

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None

    # ------------------------------------------------------------------ helpers
    def _quick(self, p: EngineTransfer[Any]) -> bool:
        """Whether a reserve or acquire can run on the loop thread: L1's arena is all reserved
        (a reserve never waits for it to grow) and the keys to hash (`_wanted`: up to the last
        chunk asked for, however long ``token_ids``) are few (~1 us each). An acquire whose
        prefix the remote tier might continue moves on to the pool (`_held`)."""
        return p.first_chunk + p.n_chunks <= _QUICK_CHUNKS and self.l1.arena.growth()[1]

    def _wanted(self, c: EngineContext, p: EngineTransfer[Any]) -> tuple[list[bytes], list[bytes]]:
        """(the keys before ``first_chunk``, the keys of the chunks asked for)."""
        if self.l1.arena.segment is None:
            raise RequestError("one-copy transfers need L1's arena in shared memory; use ENGINE_STORE")
        cs, end = self.engine.chunk_size, p.first_chunk + p.n_chunks
        keys = chunk_keys(c.scope, p.token_ids[: end * cs], cs, p.key)  # none past `end` is needed
        if end > len(keys) and p.n_chunks:
            raise RequestError(
                f"first_chunk + n_chunks = {end} exceeds the {len(keys)} full chunks of token_ids"
            )
        return keys[: p.first_chunk], keys[p.first_chunk : end]

    def _offsets(self, bufs: list[Any]) -> list[int]:
        return [self.l1.arena.offset_of(b) for b in bufs]

    # ----------------------------------------------------------------- handlers
    # Reserve and acquire touch the instance rather than hold it (`use`): they only build a
    # lease under L1's and the leases' locks, and a release meanwhile refuses to add it
    # (`Leases.add`), so it is aborted here; a release never waits for them.
    def _reserve(self, rctx: RequestContext, p: EngineReserve) -> Reserved:
        c = self.engine.registry.touch(p.instance_id, rctx.conn_fd, p.secret)
        before, wanted = self._wanted(c, p)
        cs = self.engine.chunk_size
        check_blocks(p.blocks, cs, p.first_chunk + p.n_chunks)
        describe(
            self.l1.events, wanted, p.first_chunk, p.token_ids, cs, p.blocks, before[-1] if before else None
        )
        filed = filing_scope(c.scope, p.key)  # (where the tiers file them)
        self.l1.names.learn(c.info.model_name, filed, p.blocks, p.key, wanted, p.first_chunk, cs)
        c.leases.room(self.l1)
        lease = Lease()
        _, lease.pinned = self.l1.pin_present(before)  # the prefix stays while we write
        try:
            tenant = tenant_of(p.key)
            handed, present, rejected, skipped = reserve_into(
                lease, self.l1, wanted, c.chunk_bytes, tenant, rctx.conn_fd, filed, c.words
            )
            lid = c.leases.add(lease)
        except BaseException:
            lease.abort(self.l1)
            raise
        slots = tuple(zip(handed, self._offsets(lease.bufs), strict=True))
        if rejected:
            self.metrics.rejected_chunks.inc(rejected)
        usable = self.l1.arena.growth()[0]
        return Reserved(lid, slots, c.chunk_bytes, present, rejected, skipped, len(wanted), usable)

    def _commit(self, rctx: RequestContext, p: EngineCommit) -> Committed:
        # not `use`: a release of the instance meanwhile aborts the leases still open, and this
        # one is no longer among them once taken (its bytes were written before COMMIT was sent)
        c = self.engine.registry.touch(p.instance_id, rctx.conn_fd, p.secret)
        lease = c.leases.take(p.lease)
        stored = lease.commit(self.l1, p.count)
        if p.count is not None and lease.bufs:
            c.leases.put_back(p.lease, lease, self.l1)  # the rest is still being written
        else:
            lease.abort(self.l1)  # nothing left to return: ends its mark, lets go of its pins
        self.metrics.transfer_bytes.labels(direction="store").inc(stored * c.chunk_bytes)
        return Committed(stored)

    def _acquire(self, rctx: RequestContext, p: EngineAcquire) -> Acquired:
        c = self.engine.registry.touch(p.instance_id, rctx.conn_fd, p.secret)
        _, wanted = self._wanted(c, p)
        c.leases.room(self.l1)
        bufs = self._held(rctx, wanted, tenant_of(p.key), filing_scope(c.scope, p.key))
        lease = Lease(pinned=wanted[: len(bufs)])
        try:
            lid = c.leases.add(lease)
        except BaseException:
            lease.abort(self.l1)
            raise
        self.metrics.transfer_bytes.labels(direction="retrieve").inc(len(bufs) * c.chunk_bytes)
        return Acquired(lid, tuple(self._offsets(bufs)), c.chunk_bytes, self.l1.arena.growth()[0])

    def _held(self, rctx: RequestContext, wanted: list[bytes], tenant: bytes, scope: bytes) -> list[Any]:
        """The stored prefix of ``wanted``, pinned. On the loop thread L1's only: when the remote
        tier might continue it the request is `Deferred` to the transfer pool, which reads it
        (the loop never waits on Redis)."""
        if not rctx.inline or not isinstance(self.l1, TieredStore):
            return self.l1.acquire_prefix(wanted, tenant, scope)
        bufs = self.l1.acquire_local(wanted, scope)
        if bufs is None:
            raise Deferred
        return bufs

    def _release(self, rctx: RequestContext, p: EngineRelease) -> Released:
        c = self.engine.registry.touch(p.instance_id, rctx.conn_fd, p.secret)
        c.leases.take(p.lease).abort(self.l1)  # an acquire lease holds pins only
        return Released(True)
