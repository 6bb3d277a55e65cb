"""The engine-driven transport: the worker keeps ordinary tensors and copies chunks itself,
through a shared-memory pool the server owns (``pool_chunks`` slots, one batch of slots per
request), or once, straight into or out of the server's L1 arena when the server shares it
(`dataplane.client.one_copy`). ``_lock`` guards the pool and the arena (their slots are used by
one transfer at a time).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

from dataplane.client.blend import WorkerRope
from dataplane.client.one_copy import ArenaCopier
from dataplane.client.transport import NO_BLOCKS, BlendHits, Identity, Key, Send
from dataplane.memory.blockkv import BlockKV, LocalKV
from dataplane.memory.copies import ChunkMap, CopySplitter
from dataplane.memory.int8 import Int8KV, Int8Shape
from dataplane.memory.kvmemory import DTYPE_NAMES, map_local_tensors
from dataplane.memory.rope import RopeParams
from dataplane.memory.shm import Segment
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.errors import ClientError
from dataplane.wire.messages import (
    BlendRetrieve,
    BlendStore,
    EngineRegister,
    EngineRetrieve,
    EngineStore,
    KVFormat,
    Lookup,
)
from dataplane.wire.replies import ArenaInfo, PoolRegistered, Registered, StoreCounts


class EngineDrivenTransport:
    def __init__(
        self, who: Identity, pool_chunks: int, copy_threads: int = 1, kv_codec: str = "none"
    ) -> None:
        self.who = who
        self.pool_chunks = pool_chunks
        self.kv_codec = kv_codec  # "int8": chunks are quantized here as they are copied (`Int8KV`)
        # the worker copies; with copy_threads > 1 split across threads by layers (set torch's
        # own threads to 1 then: both at once oversubscribe the cores)
        self._splitter = CopySplitter(copy_threads)
        self._splitter.start()
        self.segments: list[str] = []  # the worker's tensors are its own; only the pool is shared
        self._local: LocalKV | None = None
        self._lock = threading.Lock()  # guards _pool, _arena and their memory: one transfer at a time
        self._pool: tuple[Segment, list[torch.Tensor]] | None = None
        # the server's L1 arena, when it is shared memory: one-copy transfers (client/one_copy.py)
        self._arena: tuple[Segment, ArenaCopier] | None = None
        self._rope: WorkerRope | None = None  # one-copy blend transfers rotate here

    def registration(self, caches: Sequence[torch.Tensor], kv_format: KVFormat) -> EngineRegister:
        who, first = self.who, caches[0]
        if first.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"dtype {first.dtype} is not supported; use one of {sorted(DTYPE_NAMES.values())}"
            )
        local: LocalKV
        if kv_format is not KVFormat.TOKEN_MAJOR:
            local = BlockKV.of_engine(caches, kv_format)
        else:
            if len(first.shape) != 5 or first.shape[0] != 2:
                raise ValueError("KV tensors must be [2, num_blocks, block_size, heads, head_dim]")
            for i, t in enumerate(caches):
                if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                    raise ValueError(f"layer {i}: shape/dtype differ from layer 0 or not contiguous")
            local = map_local_tensors(list(caches))
        if self.kv_codec == "int8":
            if first.device.type != "cpu":
                raise ValueError(
                    "kv_compression int8 quantizes KV on the CPU only, not on " + first.device.type
                )
            shape = Int8Shape(kv_format, len(caches), local.heads, local.head_dim, local.block_size)
            self._local = Int8KV(local, shape, first.dtype)
        else:
            self._local = local
        return EngineRegister(
            who.instance_id,
            who.secret,
            who.model_name,
            who.world_size,
            who.worker_id,
            DTYPE_NAMES[first.dtype],
            len(caches),
            local.heads,
            local.head_dim,
            self.pool_chunks,
            who.owner_pid,
            kv_format,
            local.block_size,
            self.kv_codec,
        )

    def registered(self, result: Registered | PoolRegistered) -> None:
        """Map the pool the server handed out (kept when it is the one already mapped), and
        its L1 arena when it offers it (then transfers copy once, straight into L1)."""
        if not isinstance(result, PoolRegistered):
            raise ClientError(f"ENGINE_REGISTER answered {type(result).__name__}")
        name, slot_bytes, slots = result.segment, result.slot_bytes, result.slots
        self._map_arena(result.arena)
        with self._lock:
            if self._pool is not None and self._pool[0].name == name:
                return
            seg = Segment.attach(name, slot_bytes * slots)
            flat = seg.as_tensor()
            views = [flat[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slots)]
            old, self._pool = self._pool, (seg, views)
        if old is not None:
            _close_pool(old)

    def _map_arena(self, arena: ArenaInfo | None) -> None:
        with self._lock:
            if arena is None:  # (a restarted server may keep L1 private: back to the pool)
                old, self._arena = self._arena, None
                if old is not None:
                    old[1].close()
                    old[0].close()
                return
            if self._arena is not None and self._arena[0].name == arena.segment:
                return
            # sparse: the server reserves its space as it grows and hands out only what it has
            seg = Segment.attach(arena.segment, arena.bytes, allow_sparse=True)
            copier = ArenaCopier(self.who.instance_id, self.who.secret, seg.as_tensor(), arena.usable)
            old, self._arena = self._arena, (seg, copier)
        if old is not None:
            old[1].close()
            old[0].close()

    def store(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        chunk_size: int | None,
        ctx: Key = None,
        names: EngineBlocks | None = None,
        first: int = 0,
    ) -> StoreCounts:
        cs, local = self._require_local(chunk_size)
        with self._lock:
            if self._arena is not None:
                return self._arena[1].store(
                    send, local, tokens, blocks, cs, self._splitter, ctx, names, first
                )
        n_full = len(tokens) // cs
        # the chunks held need no copy
        present = send(Lookup(self.who.instance_id, self.who.secret, tokens, ctx)).hit_tokens // cs
        chunks = ChunkMap(blocks, local.block_size, local.num_blocks, n_full, cs, first)
        total = StoreCounts(max(0, n_full - first), 0, max(0, present - first), 0, 0)  # (from ``first``)
        first = max(first, present)
        with self._lock:
            pool = self._slots()
            while first < n_full:
                k = min(len(pool), n_full - first)
                for i in range(k):
                    c = first + i
                    local.gather(chunks[c], pool[i], self._splitter)
                r = send(
                    EngineStore(
                        self.who.instance_id,
                        self.who.secret,
                        tokens[: (first + k) * cs],
                        first,
                        k,
                        ctx,
                        names,
                    )
                )
                total = total.plus_round(r)
                if r.rejected:
                    total = total.plus(rejected=n_full - first - k)
                    break
                if r.skipped:  # the server is unhealthy: it writes nothing now
                    total = total.plus(skipped=n_full - first - k)
                    break
                first += k
        return total

    def retrieve(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        chunk_size: int | None,
        ctx: Key = None,
        first: int = 0,
    ) -> int:
        cs, local = self._require_local(chunk_size)
        with self._lock:
            if self._arena is not None:
                return self._arena[1].retrieve(send, local, tokens, blocks, cs, self._splitter, ctx, first)
        n_full = len(tokens) // cs
        start = first
        with self._lock:
            pool = self._slots()
            while first < n_full:
                k = min(len(pool), n_full - first)
                msg = EngineRetrieve(
                    self.who.instance_id, self.who.secret, tokens[: (first + k) * cs], first, k, ctx
                )
                got = send(msg).chunks
                chunks = ChunkMap(
                    blocks, local.block_size, local.num_blocks, first + got, cs, start, holes=True
                )
                for i in range(got):
                    c = first + i
                    local.scatter(chunks[c], pool[i], self._splitter)
                first += got
                if got < k:
                    break
        return first * cs

    def store_blend(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        position: int,
        chunk_size: int | None,
        ctx: Key = None,
    ) -> StoreCounts:
        """One copy through L1's arena when the server shares it (this worker rotating), else
        chunk i of a batch in pool slot i, as many chunks a request as the pool has slots."""
        cs, local = self._require_local(chunk_size)
        with self._lock:
            if self._arena is not None and self._rope is not None:
                return self._arena[1].store_blend(
                    send, self._rope, local, tokens, blocks, position, cs, self._splitter, ctx
                )
        n_full = len(tokens) // cs
        chunks = ChunkMap(blocks, local.block_size, local.num_blocks, n_full, cs)
        total = StoreCounts(n_full, 0, 0, 0, 0)
        with self._lock:
            pool = self._slots()
            for first in range(0, n_full, len(pool)):
                k = min(len(pool), n_full - first)
                for i in range(k):
                    c = first + i
                    local.gather(chunks[c], pool[i], self._splitter)
                batch = tokens[first * cs : (first + k) * cs]
                at = position + first * cs
                window = None if ctx is None else ctx.window(first * cs)
                r = send(BlendStore(self.who.instance_id, self.who.secret, batch, NO_BLOCKS, at, window))
                total = total.plus_round(r)
        return total

    def retrieve_blend(
        self,
        send: Send,
        tokens: np.ndarray,
        blocks: np.ndarray,
        position: int,
        chunk_size: int | None,
        ctx: Key = None,
    ) -> BlendHits:
        cs, local = self._require_local(chunk_size)
        with self._lock:
            if self._arena is not None and self._rope is not None:
                rope, splitter = self._rope, self._splitter
                return self._arena[1].retrieve_blend(
                    send, rope, local, tokens, blocks, position, cs, splitter, ctx
                )
        n_full = len(tokens) // cs
        chunks = ChunkMap(blocks, local.block_size, local.num_blocks, n_full, cs)
        hits: BlendHits = []
        with self._lock:
            pool = self._slots()
            for first in range(0, n_full, len(pool)):
                batch = tokens[first * cs : (first + min(len(pool), n_full - first)) * cs]
                at = position + first * cs
                window = None if ctx is None else ctx.window(first * cs)
                msg = BlendRetrieve(self.who.instance_id, self.who.secret, batch, NO_BLOCKS, at, window)
                for i, hit in send(msg).chunks:
                    c = first + i
                    if hit:
                        local.scatter(chunks[c], pool[i], self._splitter)
                    hits.append((c, hit))
        return hits

    def set_rope(self, params: RopeParams) -> None:
        with self._lock:
            old, self._rope = self._rope, WorkerRope(params)
        if old is not None:
            old.close()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            arena, self._arena = self._arena, None
            rope, self._rope = self._rope, None
        if rope is not None:
            rope.close()
        if pool is not None:
            _close_pool(pool)
        if arena is not None:
            arena[1].close()  # the view (and the thread reading it) go before the mapping
            arena[0].close()
        self._splitter.stop()

    def _require_local(self, chunk_size: int | None) -> tuple[int, LocalKV]:
        if self._local is None or chunk_size is None:
            raise ClientError("register_kv_caches() first")
        return chunk_size, self._local

    def _slots(self) -> list[torch.Tensor]:
        """The pool's slots; lock held."""
        if self._pool is None:
            raise ClientError("register_kv_caches() first")
        return self._pool[1]


def _close_pool(pool: tuple[Segment, list[torch.Tensor]]) -> None:
    pool[1].clear()  # drop the views before the mapping goes
    pool[0].close()
