"""The server-driven transfer module: the server copies between worker memory and its tiers.

REGISTER_KV_CACHE maps the worker's per-layer KV tensors; STORE gathers every full chunk not
yet stored into L1; RETRIEVE scatters the longest stored prefix into the given blocks. KV bytes
never cross the socket. LOOKUP (`dataplane.modules.lookup`) reads an instance's chunk-key scope
through ``scope_of``; UNREGISTER_KV_CACHE (`dataplane.modules.management`), the reaper and the
admin reap release an instance through the release path, which reaches this module's registry.

The per-instance contexts and their liveness live in the module's `LivenessRegistry` behind one
leaf lock, never held across mapping memory, a copy, a storage call or another component.
Outside readers use its locked accessors only. A context in use by a transfer is released by
its last user, so an UNREGISTER or reap racing a copy never unmaps memory under it.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataplane.events.describe import check_blocks, describe
from dataplane.liveness.entry import Entry, InstanceInfo
from dataplane.liveness.quota import InstanceQuota
from dataplane.liveness.registry import Clock
from dataplane.memory.budget import ByteBudget, DescriptorReserve
from dataplane.memory.copies import ChunkMap, CopySplitter
from dataplane.memory.kvmemory import TORCH_DTYPES, MappedKV, map_registration
from dataplane.memory.shm import unlink_if_owner_gone
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.modules.transfer_common import TransferModule
from dataplane.storage.keys import chunk_keys, filing_scope, scope_digest
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.tenants import tenant_of
from dataplane.wire.errors import RequestError
from dataplane.wire.messages import MsgType, Register, Retrieve, Store, Transfer, TransferMode
from dataplane.wire.replies import Registered, Retrieved, StoreCounts

logger = logging.getLogger(__name__)
_Views = list[memoryview] | None  # where a chunk read in place goes (None: not in place)


@dataclass(eq=False)
class CacheContext(Entry):
    """One registered worker: its mapping, its chunk-key scope and its liveness fields."""

    layout: bytes = b""  # digest of the registered layout: a repeat register compares it
    kv: MappedKV | None = None
    mapped_bytes: int = 0  # of worker memory, counted in the mapped budget


class ServerDrivenTransferModule(TransferModule[CacheContext]):
    name = TransferMode.SERVER_DRIVEN.value

    def __init__(
        self,
        l1: L1Store,
        chunk_size: int,
        metrics: DataPlaneMetrics,
        clock: Clock = time.monotonic,
        release_timeout_s: float = 10.0,
        splitter: CopySplitter | None = None,
        quota: InstanceQuota | None = None,
        descriptors: DescriptorReserve | None = None,
        mapped_budget: ByteBudget | None = None,
    ) -> None:
        super().__init__(l1, chunk_size, metrics, clock, release_timeout_s, splitter, quota, descriptors)
        self.mapped_budget = mapped_budget  # worker memory mapped, every instance of this server

    def handlers(self) -> dict[MsgType, Handler]:
        return {
            MsgType.REGISTER_KV_CACHE: Handler(self._register),
            MsgType.STORE: Handler(self._store, self.order_key),
            MsgType.RETRIEVE: Handler(self._retrieve, self.order_key),
        }

    # ------------------------------------------------------------- internals
    def _release(self, c: CacheContext, why: str) -> None:
        assert c.kv is not None
        closed = c.kv.release()
        if self.mapped_budget is not None:
            self.mapped_budget.give_back(c.mapped_bytes)
        for seg in c.kv.segments:
            unlink_if_owner_gone(seg.name)
        logger.info(
            "transfer: released instance %d (%s%s)",
            c.instance_id,
            why,
            "" if closed else "; mapping freed when its last view goes",
        )

    # -------------------------------------------------------------- handlers
    def _register(self, rctx: RequestContext, reg: Register) -> Registered:
        layout = _layout_digest(reg)
        if self.registry.refresh_if(reg.instance_id, lambda c: c.layout == layout, rctx.conn_fd, reg.secret):
            return Registered(False, self.chunk_size)  # a repeat: refreshed
        nbytes = _registered_bytes(reg)
        if self.descriptors is not None:
            self.descriptors.check(f"the KV cache of instance {reg.instance_id}")
        if self.mapped_budget is not None:
            self.mapped_budget.take(nbytes, f"the KV cache of instance {reg.instance_id}")
        kv: MappedKV | None = None
        try:
            kv = map_registration(reg)  # slow (maps and pre-faults): outside the lock
            self.registry.put(self._context(rctx, reg, layout, kv, nbytes), "re-registered with a new layout")
        except BaseException:
            if kv is not None:
                kv.release()
            if self.mapped_budget is not None:
                self.mapped_budget.give_back(nbytes)
            raise
        logger.info(
            "transfer: registered instance %d (%s, rank %d/%d, %d layers, %s)",
            reg.instance_id,
            reg.model_name,
            reg.worker_id,
            reg.world_size,
            len(reg.layers),
            reg.memory.value,
        )
        return Registered(True, self.chunk_size)

    def _context(
        self, rctx: RequestContext, reg: Register, layout: bytes, kv: MappedKV, nbytes: int
    ) -> CacheContext:
        _, _, _, heads, hd = reg.kv_shape
        scope = scope_digest(
            reg.model_name, reg.world_size, reg.worker_id, reg.dtype, len(reg.layers), heads, hd
        )
        now = self._clock()
        info = InstanceInfo(
            reg.transfer_mode.value,
            reg.memory.value,
            reg.model_name,
            reg.world_size,
            reg.worker_id,
            reg.owner_pid,
            len(reg.layers),
            reg.dtype,
        )
        return CacheContext(
            reg.instance_id,
            now,
            now,
            scope,
            info,
            conn_fd=rctx.conn_fd,
            secret=reg.secret,
            layout=layout,
            kv=kv,
            mapped_bytes=nbytes,
        )

    def _chunks(self, kv: MappedKV, p: Transfer[Any], n_chunks: int) -> ChunkMap:
        """Where each of the first ``n_chunks`` chunks lives in the worker's blocks."""
        try:
            return ChunkMap(p.block_ids, kv.block_size, kv.num_blocks, n_chunks, self.chunk_size)
        except ValueError as exc:
            raise RequestError(str(exc)) from None

    def _into(self, kv: MappedKV, p: Retrieve, n_chunks: int) -> Callable[[int, int], _Views]:
        """Where chunk i of a RETRIEVE goes, as byte views of the worker's blocks, for a chunk
        file read in place (None: not here: a GPU, a chunk of another size, too few blocks)."""
        want = kv.chunk_nbytes(self.chunk_size)
        chunks: list[ChunkMap] = []

        def into(i: int, nbytes: int) -> _Views:
            if nbytes != want:
                return None
            if not chunks:
                try:
                    cs = self.chunk_size
                    chunks.append(ChunkMap(p.block_ids, kv.block_size, kv.num_blocks, n_chunks, cs))
                except ValueError:
                    return None
            return kv.chunk_views(chunks[0][i])

        return into

    def _store(self, rctx: RequestContext, p: Store) -> StoreCounts:
        with self.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            kv = c.kv
            assert kv is not None
            self._check_blocks(kv, p)
            keys = chunk_keys(c.scope, p.token_ids, self.chunk_size, p.key)
            chunks = self._chunks(kv, p, len(keys))
            check_blocks(p.blocks, self.chunk_size, len(keys))
            describe(self.l1.events, keys, 0, p.token_ids, self.chunk_size, p.blocks, None)
            filed = filing_scope(c.scope, p.key)  # (where the tiers file them)
            self.l1.names.learn(c.info.model_name, filed, p.blocks, p.key, keys, 0, self.chunk_size)

            def fill(i: int, buf: torch.Tensor) -> None:
                kv.gather(chunks[i], buf, self.splitter)

            nbytes = kv.chunk_nbytes(self.chunk_size)
            return self.write_chunks(
                p.instance_id,
                keys,
                nbytes,
                fill,
                tenant=tenant_of(p.key),
                conn_fd=rctx.conn_fd,
                scope=filed,
                words=c.info.dtype,
            )

    @staticmethod
    def _check_blocks(kv: MappedKV, p: Transfer[Any]) -> None:
        """Every block id given must lie in the registered cache, hit or miss."""
        ids = p.block_ids
        if not len(ids) or (ids.min() >= 0 and ids.max() < kv.num_blocks):  # two reductions
            return
        i = int(np.flatnonzero((ids < 0) | (ids >= kv.num_blocks))[0])
        raise RequestError(
            f"block_ids[{i}]: block {int(ids[i])} is outside the registered cache [0, {kv.num_blocks})"
        )

    def _retrieve(self, rctx: RequestContext, p: Retrieve) -> Retrieved:
        cs = self.chunk_size
        with self.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            keys = chunk_keys(c.scope, p.token_ids, cs, p.key)
            kv = c.kv
            assert kv is not None
            self._check_blocks(kv, p)
            into = self._into(kv, p, len(keys))
            bufs = self.l1.acquire_into(
                keys,
                into,
                tenant_of(p.key),
                filing_scope(c.scope, p.key),
                rctx.after.append,
                kv.chunk_nbytes(self.chunk_size),
            )
            held = [k for k, b in zip(keys, bufs, strict=False) if b is not None]
            try:
                chunks = self._chunks(kv, p, len(bufs))
                for i, buf in enumerate(bufs):
                    if buf is not None:  # (None: read in place from a chunk file)
                        kv.scatter(chunks[i], buf, self.splitter)
            finally:
                self.l1.release(held)
            nbytes = kv.chunk_nbytes(cs) * len(bufs)
        self.metrics.transfer_bytes.labels(direction="retrieve").inc(nbytes)
        self.metrics.lookup_tokens.inc(len(p.token_ids))
        self.metrics.hit_tokens.inc(len(bufs) * cs)
        return Retrieved(len(bufs) * cs)


def _registered_bytes(reg: Register) -> int:
    """The bytes of worker memory a registration maps: every layer's [2, blocks, ...] tensor."""
    elems = 1
    for d in reg.kv_shape:
        elems *= d
    return elems * torch.empty((), dtype=TORCH_DTYPES[reg.dtype]).element_size() * len(reg.layers)


def _layout_digest(reg: Register) -> bytes:
    """Everything a REGISTER describes but the id, hashed (a context keeps 16 bytes, not the
    per-layer descriptions)."""
    key = (
        reg.model_name,
        reg.world_size,
        reg.worker_id,
        reg.transfer_mode,
        reg.memory,
        reg.dtype,
        reg.kv_shape,
        reg.layers,
    )
    return hashlib.blake2b(repr(key).encode(), digest_size=16).digest()
