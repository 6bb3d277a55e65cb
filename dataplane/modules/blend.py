"""The blend module: chunks reused at any position (after CacheBlend), with per-instance RoPE.

BLEND_REGISTER gives an instance's RoPE parameters; the module checks them against the
instance's head dim and builds its cos/sin tables once (`dataplane.memory.rope.RopeTables`).
BLEND_STORE keeps each full chunk under a key of its own tokens only (not the prefix chain: the
same passage after any prefix is the same key), with its keys rotated back to position 0.
BLEND_RETRIEVE looks each chunk up independently and writes the ones held with their keys
rotated to the chunk's target position; values are never touched. The answer says which
chunks were hit, so the engine recomputes the others (and, as CacheBlend does, the
cross-attention between chunks).

Both transfer modes: a server-driven instance's chunks move between L1 and its mapped cache
(``block_ids``, as for STORE); an engine-driven one's through its chunk pool, chunk i of the
request in slot i (``block_ids`` empty: the worker copies its own blocks). The rotation is one
pass from source to destination with the compiled kernels once they are ready
(`dataplane.memory.blendcopy`, compiled on a thread of their own after the first
BLEND_REGISTER), torch until then and for other dtypes and CUDA memory.

The tables are per-instance state and nothing else: the module is a liveness target that
overrides only ``drop_instance_state``, so a reap, an admin reap or an UNREGISTER drops them.
``_lock`` guards ``_tables``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dataplane.liveness.target import InstanceLivenessTarget
from dataplane.memory.blendcopy import Geometry, Side, cache_side, chunk_side, move
from dataplane.memory.copies import token_slots
from dataplane.memory.kvmemory import DTYPE_NAMES, TORCH_DTYPES, MappedKV
from dataplane.memory.rope import RopeParams, RopeTables
from dataplane.memory.rope_kernel import KernelWarmup
from dataplane.modules.base import Handler, RequestContext
from dataplane.modules.engine_pool import EngineDrivenTransferModule
from dataplane.modules.server_driven import ServerDrivenTransferModule
from dataplane.storage.keys import blend_keys, filing_scope
from dataplane.storage.l1.tenants import tenant_of
from dataplane.wire.errors import RequestError
from dataplane.wire.messages import (
    BlendRegister,
    BlendRetrieve,
    BlendStore,
    BlendTransfer,
    KVFormat,
    MsgType,
)
from dataplane.wire.replies import BlendRegistered, BlendRetrieved, StoreCounts


@dataclass(frozen=True)
class _Opened:
    """What a blend transfer works with: the instance's tables, the chunk geometry, each full
    chunk's key, and the worker's side: its mapped cache and token slots (server-driven) or its
    pool's slots (engine-driven)."""

    tables: RopeTables
    g: Geometry
    keys: list[bytes]
    chunk_bytes: int
    kv: MappedKV | None = None
    slots: np.ndarray | None = None
    pool: list[torch.Tensor] | None = None
    scope: bytes = b""  # the keys' scope (where lower tiers file them)

    def worker_side(self, i: int) -> Side:
        if self.pool is not None:
            return chunk_side(self.pool[i], self.g)
        assert self.kv is not None and self.slots is not None
        return cache_side(self.kv, self.chunk_slots(i))

    def chunk_slots(self, i: int) -> np.ndarray:
        assert self.slots is not None
        cs = self.g.tokens
        return self.slots[i * cs : (i + 1) * cs]


class BlendModule(InstanceLivenessTarget):
    name = "blend"

    def __init__(self, transfer: ServerDrivenTransferModule, engine: EngineDrivenTransferModule) -> None:
        self.transfer = transfer
        self.engine = engine
        self.chunk_size = transfer.chunk_size
        self.kernels = KernelWarmup()  # compiled after the first BLEND_REGISTER
        self._lock = threading.Lock()  # guards _tables
        self._tables: dict[int, RopeTables] = {}

    def handlers(self) -> dict[MsgType, Handler]:
        key = self.transfer.order_key
        return {
            MsgType.BLEND_REGISTER: Handler(self._register),
            MsgType.BLEND_STORE: Handler(self._store, key),
            MsgType.BLEND_RETRIEVE: Handler(self._retrieve, key),
        }

    def start(self) -> None:
        return None

    def stop(self) -> None:
        self.kernels.stop()
        self.kernels.join(10.0)

    def close(self) -> None:
        with self._lock:
            self._tables.clear()

    def instance_count(self) -> int:
        with self._lock:
            return len(self._tables)

    # ------------------------------------------------------------ liveness
    def drop_instance_state(self, instance_id: int) -> None:
        with self._lock:
            self._tables.pop(instance_id, None)

    # ------------------------------------------------------------ handlers
    def _is_engine_driven(self, rctx: RequestContext, iid: int, secret: bytes) -> bool:
        return self.engine.registry.scope_of(iid, rctx.conn_fd, secret) is not None

    def _head_dim(self, rctx: RequestContext, p: BlendRegister) -> int:
        if self._is_engine_driven(rctx, p.instance_id, p.secret):
            with self.engine.registry.use(p.instance_id, rctx.conn_fd, p.secret) as e:
                assert e.reg is not None
                if e.reg.kv_format is not KVFormat.TOKEN_MAJOR:
                    raise RequestError(
                        f"instance {p.instance_id} registered {e.reg.kv_format.value} memory: blend "
                        "transfers need the token_major layout"
                    )
                if e.reg.kv_codec != "none":
                    raise RequestError(
                        f"instance {p.instance_id} stores {e.reg.kv_codec} chunks: blend transfers "
                        "move raw KV only (register without kv_codec for blending)"
                    )
                return e.reg.head_dim
        with self.transfer.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            assert c.kv is not None
            return c.kv.head_dim

    def _register(self, rctx: RequestContext, p: BlendRegister) -> BlendRegistered:
        head_dim = self._head_dim(rctx, p)
        params = RopeParams(p.rotary_dim, p.base, p.style, p.scaling, p.max_positions)
        try:
            params.check(head_dim)
        except ValueError as exc:
            raise RequestError(f"BLEND_REGISTER.{exc}") from None
        tables = RopeTables(params)  # built once, outside every lock
        with self._lock:
            self._tables[p.instance_id] = tables
        self.kernels.start()  # (once: compiled on its own thread, torch until then)
        return BlendRegistered(tables.nbytes)

    def tables_of(self, iid: int) -> RopeTables:
        with self._lock:
            t = self._tables.get(iid)
        if t is None:
            raise RequestError(
                f"instance {iid} has not registered its RoPE parameters (BLEND_REGISTER first)"
            )
        return t

    @contextlib.contextmanager
    def _open(self, rctx: RequestContext, p: BlendTransfer[Any]) -> Iterator[_Opened]:
        """What BLEND_STORE and BLEND_RETRIEVE both check and derive (the instance held in use
        meanwhile)."""
        tables, cs = self.tables_of(p.instance_id), self.chunk_size
        if self._is_engine_driven(rctx, p.instance_id, p.secret):
            with self.engine.registry.use(p.instance_id, rctx.conn_fd, p.secret) as e:
                assert e.reg is not None and e.strategy is not None
                if len(p.block_ids):
                    raise RequestError(
                        "block_ids: an engine_driven instance copies its own blocks through its pool: send "
                        "none"
                    )
                keys = blend_keys(e.scope, p.token_ids, cs, p.key)
                if len(keys) > len(e.strategy.slots):
                    raise RequestError(
                        f"token_ids: {len(keys)} chunks exceed the pool's {len(e.strategy.slots)} slots "
                        "(a blend request of an engine_driven instance carries at most one chunk per slot)"
                    )
                self._check_span(tables, p.position, len(keys))
                r = e.reg
                g = Geometry(TORCH_DTYPES[r.dtype], r.num_layers, cs, r.heads, r.head_dim)
                filed = filing_scope(e.scope, p.key)
                yield _Opened(tables, g, keys, e.chunk_bytes, pool=e.strategy.slots, scope=filed)
            return
        with self.transfer.registry.use(p.instance_id, rctx.conn_fd, p.secret) as c:
            kv = c.kv
            assert kv is not None
            keys = blend_keys(c.scope, p.token_ids, cs, p.key)
            try:
                slots = token_slots(p.block_ids, kv.block_size, kv.num_blocks, len(keys) * cs)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
            self._check_span(tables, p.position, len(keys))
            g = Geometry(kv.dtype, kv.num_layers, cs, kv.heads, kv.head_dim)
            filed = filing_scope(c.scope, p.key)
            yield _Opened(tables, g, keys, kv.chunk_nbytes(cs), kv=kv, slots=slots, scope=filed)

    def _check_span(self, tables: RopeTables, position: int, chunks: int) -> None:
        try:
            tables.params.check_span(position, chunks * self.chunk_size)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _store(self, rctx: RequestContext, p: BlendStore) -> StoreCounts:
        cs, splitter = self.chunk_size, self.transfer.splitter
        with self._open(rctx, p) as o:

            def raw(i: int, work: torch.Tensor) -> None:  # the chunk's bytes as they are
                if o.kv is not None:
                    o.kv.gather(o.chunk_slots(i), work, splitter)
                else:
                    assert o.pool is not None
                    work.copy_(o.pool[i])

            def fill(i: int, buf: torch.Tensor) -> None:  # keys as if the chunk were at 0
                src, dst = o.worker_side(i), chunk_side(buf, o.g)
                offset = -(p.position + i * cs)
                move(o.tables, src, dst, offset, o.g, splitter, self.kernels.ready, lambda w: raw(i, w))

            tenant = tenant_of(p.key)
            return self.transfer.write_chunks(
                p.instance_id,
                o.keys,
                o.chunk_bytes,
                fill,
                tenant=tenant,
                conn_fd=rctx.conn_fd,
                scope=o.scope,
                words=DTYPE_NAMES.get(o.g.dtype),
            )

    def _retrieve(self, rctx: RequestContext, p: BlendRetrieve) -> BlendRetrieved:
        cs, l1 = self.chunk_size, self.transfer.l1
        with self._open(rctx, p) as o:
            hits: list[tuple[int, bool]] = []
            for i, key in enumerate(o.keys):
                got = l1.acquire_prefix([key], tenant_of(p.key), o.scope)
                if got:
                    try:
                        self._deliver(o, i, got[0], p.position + i * cs)
                    finally:
                        l1.release([key])
                hits.append((i, bool(got)))
        n_hit = sum(1 for _, h in hits if h)
        self.transfer.metrics.transfer_bytes.labels(direction="retrieve").inc(n_hit * o.chunk_bytes)
        return BlendRetrieved(tuple(hits))

    def _deliver(self, o: _Opened, i: int, stored: torch.Tensor, offset: int) -> None:
        """A stored chunk (keys at position 0) to the worker's side, keys rotated to ``offset``."""
        splitter = self.transfer.splitter

        def drain(work: torch.Tensor) -> None:
            assert o.kv is not None
            o.kv.scatter(o.chunk_slots(i), work, splitter)

        src, dst = chunk_side(stored, o.g), o.worker_side(i)
        move(o.tables, src, dst, offset, o.g, splitter, self.kernels.ready, lambda w: w.copy_(stored), drain)
