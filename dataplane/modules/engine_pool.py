"""The engine-driven transfer module: the worker copies, through a chunk pool the server owns.

For workers whose KV tensors the server cannot map (ordinary, non-shared tensors), ENGINE_REGISTER
creates a per-instance *strategy*: a shared-memory pool of ``pool_chunks`` chunk slots that the
server owns and the worker maps. ENGINE_STORE: the worker has copied chunks into the slots;
the server copies the missing ones into L1 (one copy each). ENGINE_RETRIEVE: the server fills
slots from L1; the worker copies them into its blocks. A context and its strategy live in one
entry of the module's `LivenessRegistry`, inserted and popped as one under the registry's lock,
so a reap racing a re-register can never leave a context without its strategy. LOOKUP,
UNREGISTER_KV_CACHE and liveness reach these instances as they reach server-driven ones
(`dataplane.modules.server_driven`).

When L1's arena is a server-owned segment, ENGINE_REGISTER's reply names it too: the one-copy
modules (`dataplane.modules.one_copy`, `dataplane.modules.blend_one_copy`) serve this module's
instances, and their leases live in its entries (``EngineContext.leases``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dataplane.events.describe import check_blocks, describe
from dataplane.liveness.entry import Entry, InstanceInfo
from dataplane.liveness.quota import InstanceQuota
from dataplane.liveness.registry import Clock
from dataplane.memory.budget import ByteBudget, DescriptorReserve
from dataplane.memory.copies import CopySplitter
from dataplane.memory.int8 import FLOAT_DTYPES, Int8Shape
from dataplane.memory.kvmemory import TORCH_DTYPES
from dataplane.memory.shm import Segment
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.modules.leases import Leases
from dataplane.modules.transfer_common import TransferModule
from dataplane.storage.keys import chunk_keys, filing_scope, scope_digest
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.tenants import tenant_of
from dataplane.wire.errors import InvalidLayout, LimitExceeded, RequestError
from dataplane.wire.messages import (
    EngineRegister,
    EngineRetrieve,
    EngineStore,
    EngineTransfer,
    KVFormat,
    MemoryKind,
    MsgType,
    TransferMode,
)
from dataplane.wire.replies import ArenaInfo, PoolRegistered, PoolRetrieved, StoreCounts

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class PoolStrategy:
    """The chunk pool of one instance: ``slots[i]`` is one chunk's bytes."""

    segment: Segment
    slots: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.segment.size

    def release(self) -> None:
        self.slots = []
        self.segment.close()
        self.segment.unlink()


def _new_pool(chunk_bytes: int, chunks: int) -> PoolStrategy:
    """A segment of ``chunks`` slots, its space reserved (a full segment directory refuses here,
    with the reason, instead of faulting at the first copy)."""
    try:
        seg = Segment.create(chunk_bytes * chunks)
    except OSError as exc:
        raise LimitExceeded(f"cannot create a chunk pool: {exc}", "segment_space") from None
    flat = seg.as_tensor()
    return PoolStrategy(seg, [flat[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(chunks)])


@dataclass(eq=False)
class EngineContext(Entry):
    """The context and its strategy live in one entry: popped together by construction."""

    reg: EngineRegister | None = None
    chunk_bytes: int = 0
    strategy: PoolStrategy | None = None
    leases: Leases = field(default_factory=Leases)  # one-copy transfers in progress

    @property
    def words(self) -> str | None:
        """The dtype of its chunks' elements (which lower tiers may code): int8 chunks are bytes."""
        if self.reg is not None and self.reg.kv_codec != "none":
            return "uint8"
        return self.info.dtype


class EngineDrivenTransferModule(TransferModule[EngineContext]):
    name = TransferMode.ENGINE_DRIVEN.value

    def __init__(
        self,
        l1: L1Store,
        chunk_size: int,
        metrics: DataPlaneMetrics,
        clock: Clock = time.monotonic,
        release_timeout_s: float = 10.0,
        max_pool_bytes: int = 4 << 30,
        splitter: CopySplitter | None = None,
        quota: InstanceQuota | None = None,
        descriptors: DescriptorReserve | None = None,
        pool_budget: ByteBudget | None = None,
    ) -> None:
        super().__init__(l1, chunk_size, metrics, clock, release_timeout_s, splitter, quota, descriptors)
        self.max_pool_bytes = max_pool_bytes  # one instance's pool
        self.pool_budget = pool_budget  # every pool of this server

    def handlers(self) -> dict[MsgType, Handler]:
        return {
            MsgType.ENGINE_REGISTER: Handler(self._register),
            MsgType.ENGINE_STORE: Handler(self._store, self.order_key),
            MsgType.ENGINE_RETRIEVE: Handler(self._retrieve, self.order_key),
        }

    # ---------------------------------------------------------------- hooks
    def _release(self, c: EngineContext, why: str) -> None:
        c.leases.abort_all(self.l1)  # nothing half-written stays, no buffer or pin is left
        if c.strategy is not None:
            c.strategy.release()
            if self.pool_budget is not None:
                self.pool_budget.give_back(c.strategy.nbytes)
        logger.info("engine: released instance %d (%s)", c.instance_id, why)

    # ------------------------------------------------------------- handlers
    def _register(self, rctx: RequestContext, reg: EngineRegister) -> PoolRegistered:
        if reg.kv_format is not KVFormat.TOKEN_MAJOR and self.chunk_size % reg.block_size:
            raise InvalidLayout(
                f"block_size: the server's chunk_size {self.chunk_size} is not a multiple of the "
                f"engine's block size {reg.block_size} ({reg.kv_format.value} chunks move in whole "
                "blocks): start the server with a --chunk-size that is"
            )
        chunk_bytes = self._chunk_bytes(reg)
        old = self.registry.refresh_if(
            reg.instance_id, lambda c: c.strategy is not None and c.reg == reg, rctx.conn_fd, reg.secret
        )
        if old is not None and old.strategy is not None:  # a repeat register: refreshed
            return self._pool_info(old.strategy, chunk_bytes, created=False)
        pool_bytes = chunk_bytes * reg.pool_chunks
        if pool_bytes > self.max_pool_bytes:
            raise RequestError(
                f"pool_chunks: {reg.pool_chunks} chunks of {chunk_bytes} bytes exceed the pool "
                f"limit of {self.max_pool_bytes} bytes"
            )
        if self.descriptors is not None:
            self.descriptors.check(f"the chunk pool of instance {reg.instance_id}")
        if self.pool_budget is not None:
            self.pool_budget.take(pool_bytes, f"the chunk pool of instance {reg.instance_id}")
        strat: PoolStrategy | None = None
        try:
            strat = _new_pool(chunk_bytes, reg.pool_chunks)  # slow: outside the lock
            self.registry.put(self._context(rctx, reg, chunk_bytes, strat), "re-registered")
        except BaseException:
            if strat is not None:
                strat.release()
            if self.pool_budget is not None:
                self.pool_budget.give_back(pool_bytes)
            raise
        logger.info(
            "engine: registered instance %d (%s, rank %d/%d, pool of %d chunks)",
            reg.instance_id,
            reg.model_name,
            reg.worker_id,
            reg.world_size,
            reg.pool_chunks,
        )
        return self._pool_info(strat, chunk_bytes, created=True)

    def _chunk_bytes(self, reg: EngineRegister) -> int:
        """Bytes of one of ``reg``'s chunks, as its codec stores them."""
        if reg.kv_codec == "int8":
            if TORCH_DTYPES[reg.dtype] not in FLOAT_DTYPES:
                raise InvalidLayout(
                    f"kv_codec: int8 quantizes float KV (bfloat16, float16, float32), not {reg.dtype}"
                )
            shape = Int8Shape(reg.kv_format, reg.num_layers, reg.heads, reg.head_dim, reg.block_size)
            return shape.chunk_nbytes(self.chunk_size)
        item = torch.empty((), dtype=TORCH_DTYPES[reg.dtype]).element_size()
        row = reg.kv_format.planes * reg.heads * reg.head_dim  # a token's vectors, in a layer
        return reg.num_layers * self.chunk_size * row * item

    def _context(
        self, rctx: RequestContext, reg: EngineRegister, chunk_bytes: int, strat: PoolStrategy
    ) -> EngineContext:
        scope = scope_digest(
            reg.model_name,
            reg.world_size,
            reg.worker_id,
            reg.dtype,
            reg.num_layers,
            reg.heads,
            reg.head_dim,
            reg.kv_format.value,
            reg.block_size,
            reg.kv_codec,
        )
        now = self._clock()
        info = InstanceInfo(
            TransferMode.ENGINE_DRIVEN.value,
            MemoryKind.SHM.value,
            reg.model_name,
            reg.world_size,
            reg.worker_id,
            reg.owner_pid,
            reg.num_layers,
            reg.dtype,
        )
        return EngineContext(
            reg.instance_id,
            now,
            now,
            scope,
            info,
            conn_fd=rctx.conn_fd,
            secret=reg.secret,
            reg=reg,
            chunk_bytes=chunk_bytes,
            strategy=strat,
        )

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One chunk, split across the copy threads (in 16 slices)."""
        n = dst.numel()

        def part(lo: int, hi: int) -> None:
            a, b = n * lo // 16, n * hi // 16
            dst[a:b].copy_(src[a:b])

        if self.splitter is None:
            part(0, 16)
        else:
            self.splitter.run(part, 16)

    def _pool_info(self, s: PoolStrategy, chunk_bytes: int, created: bool) -> PoolRegistered:
        seg = self.l1.arena.segment
        # one-copy transfers: the worker maps L1's arena too
        arena = None if seg is None else ArenaInfo(seg.name, seg.size, self.l1.arena.growth()[0])
        return PoolRegistered(created, self.chunk_size, s.segment.name, chunk_bytes, len(s.slots), arena)

    def _check(self, p: EngineTransfer[Any], s: PoolStrategy, keys: list[bytes]) -> None:
        if p.n_chunks > len(s.slots):
            raise RequestError(f"n_chunks: {p.n_chunks} exceeds the pool's {len(s.slots)} slots")
        if p.first_chunk + p.n_chunks > len(keys) and p.n_chunks:
            raise RequestError(
                f"first_chunk + n_chunks = {p.first_chunk + p.n_chunks} exceeds the "
                f"{len(keys)} full chunks of token_ids"
            )

    def _batch(self, c: EngineContext, p: EngineTransfer[Any]) -> tuple[PoolStrategy, list[bytes]]:
        """The pool and every full chunk's key, the request checked against both."""
        s = c.strategy
        assert s is not None
        keys = chunk_keys(c.scope, p.token_ids, self.chunk_size, p.key)
        self._check(p, s, keys)
        return s, keys

    def _store(self, rctx: RequestContext, p: EngineStore) -> StoreCounts:
        with self.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            s, keys = self._batch(c, p)
            slots = s.slots
            first, end = p.first_chunk, p.first_chunk + p.n_chunks
            check_blocks(p.blocks, self.chunk_size, end)
            prev = keys[first - 1] if first else None
            describe(self.l1.events, keys[first:end], first, p.token_ids, self.chunk_size, p.blocks, prev)
            names = self.l1.names
            filed = filing_scope(c.scope, p.key)  # (where the tiers file them)
            names.learn(c.info.model_name, filed, p.blocks, p.key, keys[first:end], first, self.chunk_size)
            return self.write_chunks(
                p.instance_id,
                keys[p.first_chunk : p.first_chunk + p.n_chunks],
                c.chunk_bytes,
                lambda i, buf: self._copy(buf, slots[i]),
                prefix=keys[: p.first_chunk],
                tenant=tenant_of(p.key),
                conn_fd=rctx.conn_fd,
                scope=filed,
                words=c.words,
            )

    def _retrieve(self, rctx: RequestContext, p: EngineRetrieve) -> PoolRetrieved:
        with self.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            s, keys = self._batch(c, p)
            wanted = keys[p.first_chunk : p.first_chunk + p.n_chunks]
            bufs = self.l1.acquire_prefix(wanted, tenant_of(p.key), filing_scope(c.scope, p.key))
            try:
                for i, buf in enumerate(bufs):
                    self._copy(s.slots[i], buf)
            finally:
                self.l1.release(wanted[: len(bufs)])
        self.metrics.transfer_bytes.labels(direction="retrieve").inc(len(bufs) * c.chunk_bytes)
        return PoolRetrieved(len(bufs))
