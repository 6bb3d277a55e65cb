"""The server-driven transfer module: the server copies between worker memory and its tiers.

REGISTER_KV_CACHE maps the worker's per-layer KV tensors; STORE gathers every full chunk not
yet stored into L1; RETRIEVE scatters the longest stored prefix into the given blocks; LOOKUP
counts the stored prefix; UNREGISTER_KV_CACHE releases. KV bytes never cross the socket.

The per-instance dict lives behind one leaf lock (``_lock``), never held across mapping memory,
a copy, a storage call or another component. Outside readers use ``get_and_touch_context_entry``
and ``context_entries_snapshot`` only. A context in use by a transfer is released by the last
user, so an UNREGISTER or reap racing a copy never unmaps memory under it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataplane.errors import NotRegistered, RequestError
from dataplane.keys import chunk_keys, scope_digest
from dataplane.kvmemory import MappedKV, map_registration
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, HandlerKind, InstanceLivenessTarget, RequestContext
from dataplane.protocol import InstanceOnly, Lookup, MsgType, Register, Transfer
from dataplane.shm import unlink_if_owner_gone
from dataplane.storage.l1 import L1Store

logger = logging.getLogger(__name__)

Clock = Callable[[], float]


@dataclass
class CacheContext:
    """One registered worker: its mapping and its liveness fields."""

    instance_id: int
    reg: Register
    kv: MappedKV
    scope: bytes
    registered_at: float
    last_seen: float
    has_liveness_signal: bool = False
    conn_fd: int = -1
    users: int = 0  # transfers holding kv; guarded by the module lock
    removed: bool = False  # popped from the dict; the last user releases kv


@dataclass(frozen=True)
class ContextEntry:
    """A read-only copy of a context's public fields (what the sidecar sees)."""

    instance_id: int
    transfer_mode: str
    memory: str
    model_name: str
    world_size: int
    worker_id: int
    owner_pid: int
    registered_at: float
    last_seen: float
    has_liveness_signal: bool
    conn_fd: int
    num_layers: int
    kv_shape: tuple[int, ...]
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict)


def _entry(c: CacheContext) -> ContextEntry:
    r = c.reg
    return ContextEntry(c.instance_id, r.transfer_mode, r.memory.value, r.model_name,
                        r.world_size, r.worker_id, r.owner_pid, c.registered_at, c.last_seen,
                        c.has_liveness_signal, c.conn_fd, len(r.layers), r.kv_shape, r.dtype)


class ServerDrivenTransferModule(InstanceLivenessTarget):
    name = "server_driven"

    def __init__(self, l1: L1Store, chunk_size: int, metrics: DataPlaneMetrics,
                 clock: Clock = time.monotonic) -> None:
        self.l1 = l1
        self.chunk_size = chunk_size
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()  # guards _contexts and every CacheContext's mutable fields
        self._contexts: dict[int, CacheContext] = {}

    # ------------------------------------------------------------ module API
    def handlers(self) -> dict[MsgType, Handler]:
        def key(p: Any) -> int:
            return int(p.instance_id)

        return {
            MsgType.REGISTER_KV_CACHE: Handler(HandlerKind.NORMAL, self._register),
            MsgType.UNREGISTER_KV_CACHE: Handler(HandlerKind.NORMAL, self._unregister),
            MsgType.LOOKUP: Handler(HandlerKind.NORMAL, self._lookup),
            MsgType.STORE: Handler(HandlerKind.TRANSFER, self._store, key),
            MsgType.RETRIEVE: Handler(HandlerKind.TRANSFER, self._retrieve, key),
        }

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        with self._lock:
            victims = list(self._contexts.values())
            self._contexts.clear()
            for c in victims:
                c.removed = True
        for c in victims:
            if c.users == 0:
                self._release(c, "shutdown")

    def report_status(self) -> dict[str, Any]:
        return {"tracked_instances": self.tracked_instance_count()}

    # ------------------------------------------------------ locked accessors
    def get_and_touch_context_entry(self, instance_id: int) -> ContextEntry:
        """The entry of ``instance_id``, refreshing last_seen (never latching the signal)."""
        with self._lock:
            c = self._contexts.get(instance_id)
            if c is None:
                raise NotRegistered(f"instance {instance_id} is not registered")
            c.last_seen = self._clock()
            return _entry(c)

    def context_entries_snapshot(self) -> list[ContextEntry]:
        with self._lock:
            return [_entry(c) for c in self._contexts.values()]

    def context_entry(self, instance_id: int) -> ContextEntry | None:
        with self._lock:
            c = self._contexts.get(instance_id)
            return None if c is None else _entry(c)

    # -------------------------------------------------------------- liveness
    def touch_instance(self, instance_id: int, conn_fd: int = -1) -> bool:
        with self._lock:
            c = self._contexts.get(instance_id)
            if c is None:
                return False
            c.last_seen = self._clock()
            c.has_liveness_signal = True
            if conn_fd >= 0:
                c.conn_fd = conn_fd
            return True

    def tracked_instance_count(self) -> int:
        with self._lock:
            return len(self._contexts)

    def reap_stale_instances(self, timeout_s: float, grace_s: float) -> list[int]:
        now = self._clock()
        with self._lock:  # collect and pop only; release runs outside the lock
            stale = [
                c for c in self._contexts.values()
                if now - c.last_seen > (timeout_s if c.has_liveness_signal else grace_s)
            ]
            for c in stale:
                del self._contexts[c.instance_id]
                c.removed = True
            idle = [c for c in stale if c.users == 0]
        for c in stale:
            logger.warning(
                "reaper: reaped instance %d (silent %.1fs, %s)", c.instance_id,
                now - c.last_seen, "pinged" if c.has_liveness_signal else "never pinged",
            )
        for c in idle:
            self._release(c, "reap")
        return [c.instance_id for c in stale]

    def remove_instance(self, instance_id: int, why: str) -> bool:
        """The cleanup UNREGISTER, the reaper and the admin route share. False when unknown."""
        with self._lock:
            c = self._contexts.pop(instance_id, None)
            if c is None:
                return False
            c.removed = True
            idle = c.users == 0
        if idle:
            self._release(c, why)
        return True

    # ------------------------------------------------------------- internals
    @contextmanager
    def _use(self, instance_id: int, conn_fd: int) -> Iterator[CacheContext]:
        with self._lock:
            c = self._contexts.get(instance_id)
            if c is None:
                raise NotRegistered(f"instance {instance_id} is not registered")
            c.users += 1
            c.last_seen = self._clock()
            if conn_fd >= 0:
                c.conn_fd = conn_fd
        try:
            yield c
        finally:
            with self._lock:
                c.users -= 1
                last = c.removed and c.users == 0
            if last:
                self._release(c, "deferred")

    def _release(self, c: CacheContext, why: str) -> None:
        closed = c.kv.release()
        for seg in c.kv.segments:
            unlink_if_owner_gone(seg.name)
        logger.info("transfer: released instance %d (%s%s)", c.instance_id, why,
                    "" if closed else ", mapping freed when its last view goes")

    # -------------------------------------------------------------- handlers
    def _register(self, rctx: RequestContext, reg: Register) -> dict[str, Any]:
        now = self._clock()
        with self._lock:
            old = self._contexts.get(reg.instance_id)
            if old is not None and _layout_key(old.reg) == _layout_key(reg):
                old.last_seen = now  # a repeat register refreshes; it never latches
                if rctx.conn_fd >= 0:
                    old.conn_fd = rctx.conn_fd
                return {"created": False, "chunk_size": self.chunk_size}
        _, _, bs, heads, hd = reg.kv_shape
        kv = map_registration(reg)  # slow (maps and pre-faults): outside the lock
        scope = scope_digest(reg.model_name, reg.world_size, reg.worker_id, reg.dtype,
                             len(reg.layers), heads, hd)
        ctx = CacheContext(reg.instance_id, reg, kv, scope, now, self._clock(), conn_fd=rctx.conn_fd)
        with self._lock:
            replaced = self._contexts.get(reg.instance_id)
            self._contexts[reg.instance_id] = ctx
            if replaced is not None:
                replaced.removed = True
                idle = replaced.users == 0
        if replaced is not None and idle:
            self._release(replaced, "re-registered with a new layout")
        logger.info("transfer: registered instance %d (%s, rank %d/%d, %d layers, %s)",
                    reg.instance_id, reg.model_name, reg.worker_id, reg.world_size,
                    len(reg.layers), reg.memory.value)
        return {"created": True, "chunk_size": self.chunk_size}

    def _unregister(self, rctx: RequestContext, p: InstanceOnly) -> dict[str, Any]:
        return {"removed": self.remove_instance(p.instance_id, "unregister")}

    def _lookup(self, rctx: RequestContext, p: Lookup) -> dict[str, Any]:
        with self._use(p.instance_id, rctx.conn_fd) as c:
            keys = chunk_keys(c.scope, p.token_ids, self.chunk_size)
        hit = self.l1.prefix_hits(keys) * self.chunk_size
        self.metrics.lookup_tokens.inc(len(p.token_ids))
        self.metrics.hit_tokens.inc(hit)
        return {"hit_tokens": hit}

    def _slots(self, c: CacheContext, p: Transfer, n_tokens: int) -> np.ndarray:
        """Token slots (block * block_size + offset) of the first ``n_tokens`` tokens."""
        bs, nb = c.kv.block_size, c.kv.num_blocks
        need = math.ceil(n_tokens / bs)
        if len(p.block_ids) < need:
            raise RequestError(
                f"block_ids: {len(p.block_ids)} blocks cannot hold {n_tokens} tokens "
                f"(block size {bs} needs {need})"
            )
        blocks = p.block_ids[:need].astype(np.int64)
        bad = np.flatnonzero((blocks < 0) | (blocks >= nb))
        if len(bad):
            i = int(bad[0])
            raise RequestError(
                f"block_ids[{i}]: block {int(blocks[i])} is outside the registered cache "
                f"[0, {nb})"
            )
        return (np.repeat(blocks * bs, bs)[:n_tokens] + np.tile(np.arange(bs), need)[:n_tokens])

    def _store(self, rctx: RequestContext, p: Transfer) -> dict[str, Any]:
        cs = self.chunk_size
        with self._use(p.instance_id, rctx.conn_fd) as c:
            keys = chunk_keys(c.scope, p.token_ids, cs)
            slots = self._slots(c, p, len(keys) * cs)
            missing = self.l1.missing(keys)
            nbytes = c.kv.chunk_nbytes(cs)
            stored = rejected = 0
            for n, i in enumerate(missing):
                buf = self.l1.reserve(nbytes)
                if buf is None:  # nothing evictable: later chunks would be unreachable anyway
                    rejected = len(missing) - n
                    break
                try:
                    c.kv.gather(slots[i * cs:(i + 1) * cs], buf)
                except BaseException:
                    self.l1.abort(buf)
                    raise
                if self.l1.commit(keys[i], buf):
                    stored += 1
        if rejected:
            self.metrics.rejected_chunks.inc(rejected)
            logger.warning("transfer: STORE of instance %d: L1 full, %d chunk(s) not stored",
                           p.instance_id, rejected)
        self.metrics.transfer_bytes.labels(direction="store").inc(stored * nbytes)
        return {"chunks": len(keys), "stored": stored, "present": len(keys) - len(missing),
                "rejected": rejected}

    def _retrieve(self, rctx: RequestContext, p: Transfer) -> dict[str, Any]:
        cs = self.chunk_size
        with self._use(p.instance_id, rctx.conn_fd) as c:
            keys = chunk_keys(c.scope, p.token_ids, cs)
            bufs = self.l1.acquire_prefix(keys)
            held = keys[:len(bufs)]
            try:
                slots = self._slots(c, p, len(bufs) * cs)
                for i, buf in enumerate(bufs):
                    c.kv.scatter(slots[i * cs:(i + 1) * cs], buf)
            finally:
                self.l1.release(held)
            nbytes = c.kv.chunk_nbytes(cs) * len(bufs)
        self.metrics.transfer_bytes.labels(direction="retrieve").inc(nbytes)
        self.metrics.lookup_tokens.inc(len(p.token_ids))
        self.metrics.hit_tokens.inc(len(bufs) * cs)
        return {"retrieved_tokens": len(bufs) * cs}


def _layout_key(reg: Register) -> tuple[Any, ...]:
    return (reg.model_name, reg.world_size, reg.worker_id, reg.memory, reg.dtype, reg.kv_shape,
            reg.layers)

