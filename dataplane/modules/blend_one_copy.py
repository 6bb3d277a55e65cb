"""One-copy blend transfers of engine-driven workers: the worker rotates while it copies.

When L1's arena is shared memory (the worker maps it, as for one-copy ENGINE transfers), a blend
transfer's destination is the worker's own memory on the way out and an L1 buffer on the way in,
and the rotation runs where the copy does, in the worker: BLEND_RESERVE hands out L1 buffers for
the blend chunks not held (the worker writes each with its keys rotated back to position 0,
then ENGINE_COMMIT publishes them); BLEND_ACQUIRE pins each held blend chunk, looked up on its
own, and hands out its offset (the worker copies it out with its keys rotated to their new
position, then ENGINE_RELEASE). Both need the instance's BLEND_REGISTER first, as every blend
request does. The buffers are the instance's leases, aborted with it as for ENGINE transfers.
"""

from __future__ import annotations

from typing import Any

from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.modules.blend import BlendModule
from dataplane.modules.engine_pool import EngineContext, EngineDrivenTransferModule
from dataplane.modules.leases import Lease, reserve_into
from dataplane.storage.keys import blend_keys, filing_scope
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.tenants import tenant_of
from dataplane.wire.errors import RequestError
from dataplane.wire.messages import MAX_POOL_CHUNKS, BlendAcquire, BlendReserve, MsgType
from dataplane.wire.replies import BlendAcquired, Reserved


class BlendDirectModule:
    name = "blend_one_copy"

    def __init__(
        self, blend: BlendModule, engine: EngineDrivenTransferModule, l1: L1Store, metrics: DataPlaneMetrics
    ) -> None:
        self.blend = blend
        self.engine = engine
        self.l1 = l1
        self.metrics = metrics

    def handlers(self) -> dict[MsgType, Handler]:
        key = self.engine.order_key  # in arrival order with the instance's other transfers
        return {
            MsgType.BLEND_RESERVE: Handler(self._reserve, key),
            MsgType.BLEND_ACQUIRE: Handler(self._acquire, key),
        }

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None

    def _keys(self, c: EngineContext, p: BlendReserve | BlendAcquire) -> list[bytes]:
        if self.l1.arena.segment is None:
            raise RequestError("one-copy transfers need L1's arena in shared memory; use BLEND_STORE")
        self.blend.tables_of(p.instance_id)  # (BLEND_REGISTER first, as for every blend request)
        keys = blend_keys(c.scope, p.token_ids, self.engine.chunk_size, p.key)
        if len(keys) > MAX_POOL_CHUNKS:
            raise RequestError(f"token_ids: {len(keys)} chunks exceed {MAX_POOL_CHUNKS} a request")
        return keys

    def _offsets(self, bufs: list[Any]) -> list[int]:
        return [self.l1.arena.offset_of(b) for b in bufs]

    def _reserve(self, rctx: RequestContext, p: BlendReserve) -> Reserved:
        with self.engine.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            keys = self._keys(c, p)
            c.leases.room(self.l1)
            lease = Lease()
            try:
                tenant = tenant_of(p.key)
                handed, present, rejected, skipped = reserve_into(
                    lease,
                    self.l1,
                    keys,
                    c.chunk_bytes,
                    tenant,
                    rctx.conn_fd,
                    filing_scope(c.scope, p.key),
                    c.words,
                )
                lid = c.leases.add(lease)
            except BaseException:
                lease.abort(self.l1)
                raise
            slots = tuple(zip(handed, self._offsets(lease.bufs), strict=True))
        if rejected:
            self.metrics.rejected_chunks.inc(rejected)
        usable = self.l1.arena.growth()[0]
        return Reserved(lid, slots, c.chunk_bytes, present, rejected, skipped, len(keys), usable)

    def _acquire(self, rctx: RequestContext, p: BlendAcquire) -> BlendAcquired:
        with self.engine.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            keys = self._keys(c, p)
            c.leases.room(self.l1)
            lease = Lease()
            chunks: list[tuple[int, int]] = []
            try:
                for i, key in enumerate(keys):  # each chunk on its own, not a prefix
                    got = self.l1.acquire_prefix([key], tenant_of(p.key), filing_scope(c.scope, p.key))
                    if got:
                        lease.pinned.append(key)
                    chunks.append((i, self.l1.arena.offset_of(got[0]) if got else -1))
                lid = c.leases.add(lease)
            except BaseException:
                lease.abort(self.l1)
                raise
        self.metrics.transfer_bytes.labels(direction="retrieve").inc(len(lease.pinned) * c.chunk_bytes)
        return BlendAcquired(lid, tuple(chunks), c.chunk_bytes, self.l1.arena.growth()[0])
