"""One-copy engine-driven transfers, worker side: copy straight into and out of L1's arena.

When the server's L1 arena is shared memory, ENGINE_REGISTER names it and the worker maps it.
A STORE asks for buffers (ENGINE_RESERVE: the server answers with arena offsets for the chunks
it does not hold), gathers each chunk from the worker's blocks into its buffer, and commits
(ENGINE_COMMIT). A RETRIEVE asks for the held prefix (ENGINE_ACQUIRE: offsets of pinned
chunks), scatters each into the worker's blocks, and lets go (ENGINE_RELEASE). One copy each
way; the server never touches the bytes. A copy that fails lets go of its lease at once (a
RELEASE aborts a reserve: nothing half-written is ever published). The caller serialises
transfers (`dataplane.client.engine_driven.EngineDrivenTransport`'s lock).

A worker's first write to a page of its own mapping of the arena faults, one page at a time
(write faults map no neighbours): that halved a fresh server's one-copy STORE. `ArenaToucher`
therefore maps the arena into the worker ahead of the copies, on a thread of its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from dataplane.client.blend import WorkerRope
from dataplane.client.channel import Send
from dataplane.memory.blockkv import LocalKV
from dataplane.memory.copies import ChunkMap, CopySplitter, token_slots
from dataplane.memory.kvmemory import MappedKV
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.errors import ClientError, KVWardenError, RequestAborted, RequestError
from dataplane.wire.messages import (
    MAX_POOL_CHUNKS,
    BlendAcquire,
    BlendReserve,
    EngineAcquire,
    EngineCommit,
    EngineRelease,
    EngineReserve,
    KeyContext,
)
from dataplane.wire.replies import Reserved, StoreCounts

PAGE = 4096
# a long store commits what it has written every this many bytes (ENGINE_COMMIT with a count),
# so a lookup finds its first chunks held while the last are being copied
COMMIT_EVERY_BYTES = 32 << 20
LOOKAHEAD = 1 << 30  # mapped ahead of the highest offset the server has handed out
_SLICE = 32 << 20  # per step (stop waits for one step at most)


class ArenaToucher:
    """Maps the server's arena into this process ahead of use (thread ``kvwarden-arena-map``).

    Reading one byte per page maps it: a read fault maps the pages around it at once (the
    kernel's fault-around, 16 pages by default), writable, since tmpfs tracks no dirty pages;
    ~14 GB/s here against ~3.4 GB/s for a copy that faults as it writes. The thread reads up to
    ``LOOKAHEAD`` past the highest offset the server has handed out, never past what the server
    has reserved (``usable``): reading a hole of the segment would allocate it, and on a full
    tmpfs raise SIGBUS. The read is a torch reduction, so the GIL is free meanwhile.
    ``_cond`` guards ``_target``, ``_usable``, ``_done`` and ``_stopped``.
    """

    def __init__(self, arena: torch.Tensor, usable: int) -> None:
        self._arena = arena
        self._cond = threading.Condition()
        self._usable = min(usable, arena.numel())
        self._target = min(self._usable, LOOKAHEAD)
        self._done = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def mapped(self) -> int:
        """Bytes of the arena mapped here so far (from its start)."""
        with self._cond:
            return self._done

    def want(self, end: int, usable: int) -> None:
        """The server handed out offsets up to ``end``, and has ``usable`` bytes reserved."""
        with self._cond:
            self._usable = min(max(self._usable, usable), self._arena.numel())
            target = min(self._usable, end + LOOKAHEAD)
            if target > self._target:
                self._target = target
                self._cond.notify()

    def ensure(self, lo: int, hi: int) -> None:
        """Map [lo, hi) now unless the thread has: a buffer about to be written (a read fault
        maps 16 pages, a write fault one)."""
        with self._cond:
            done = self._done
        if hi > done:
            self._arena[max(lo, done) : hi : PAGE].max()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvwarden-arena-map", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def join(self, timeout_s: float = 10.0) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._done >= self._target:
                    self._cond.wait()
                if self._stopped:
                    return
                lo = self._done
                hi = min(self._target, lo + _SLICE)
            self._arena[lo:hi:PAGE].max()  # the mapping outlives us: close() joins first
            with self._cond:
                self._done = hi


def _as_mapped(local: LocalKV) -> MappedKV:
    if not isinstance(local, MappedKV):
        raise ClientError("blend transfers need KV caches registered with the token_major layout")
    return local


class ArenaCopier:
    def __init__(self, instance_id: int, secret: bytes, arena: torch.Tensor, usable: int = 0) -> None:
        self.instance_id = instance_id
        self.secret = secret
        self.arena = arena  # the server's L1 arena, as mapped here (uint8)
        self.toucher = ArenaToucher(arena, usable)
        self.toucher.start()

    def close(self) -> None:
        """Stop mapping ahead and drop the view: the mapping may go after this."""
        self.toucher.stop()
        self.toucher.join()
        self.arena = torch.empty(0, dtype=torch.uint8)

    def store(
        self,
        send: Send,
        local: LocalKV,
        tokens: np.ndarray,
        blocks: np.ndarray,
        cs: int,
        splitter: CopySplitter | None = None,
        ctx: KeyContext | None = None,
        names: EngineBlocks | None = None,
        start: int = 0,
    ) -> StoreCounts:
        n_full = len(tokens) // cs
        chunks = ChunkMap(blocks, local.block_size, local.num_blocks, n_full, cs, start)
        total = StoreCounts(max(0, n_full - start), 0, 0, 0, 0)  # (the chunks from ``start``)
        for first in range(start, n_full, MAX_POOL_CHUNKS):
            k = min(MAX_POOL_CHUNKS, n_full - first)
            upto = tokens[: (first + k) * cs]
            r = send(EngineReserve(self.instance_id, self.secret, upto, first, k, ctx, names))

            def write(c: int, buf: torch.Tensor) -> None:
                local.gather(chunks[c], buf, splitter)

            stored = self._write_reserved(send, r, first, write)
            total = total.plus(stored, r.present, r.rejected)
            if r.rejected:
                total = total.plus(rejected=n_full - first - k)
                break
            if r.skipped:  # the server is unhealthy: it writes nothing now
                total = total.plus(skipped=r.skipped + n_full - first - k)
                break
        return total

    def retrieve(
        self,
        send: Send,
        local: LocalKV,
        tokens: np.ndarray,
        blocks: np.ndarray,
        cs: int,
        splitter: CopySplitter | None = None,
        ctx: KeyContext | None = None,
        start: int = 0,
    ) -> int:
        n_full = len(tokens) // cs
        first = start
        while first < n_full:
            k = min(MAX_POOL_CHUNKS, n_full - first)
            r = send(EngineAcquire(self.instance_id, self.secret, tokens[: (first + k) * cs], first, k, ctx))
            offsets, cb = r.offsets, r.slot_bytes
            self.toucher.want(max(offsets, default=-cb) + cb, r.usable)
            with self._lease(send, r.lease, commit=False):
                chunks = ChunkMap(
                    blocks, local.block_size, local.num_blocks, first + len(offsets), cs, start, holes=True
                )
                for i, off in enumerate(offsets):
                    c = first + i
                    local.scatter(chunks[c], self.arena[off : off + cb], splitter)
            first += len(offsets)
            if len(offsets) < k:
                break
        return first * cs

    # ------------------------------------------------------------------ blend
    def store_blend(
        self,
        send: Send,
        rope: WorkerRope,
        local: LocalKV,
        tokens: np.ndarray,
        blocks: np.ndarray,
        position: int,
        cs: int,
        splitter: CopySplitter,
        ctx: KeyContext | None = None,
    ) -> StoreCounts:
        """BLEND_RESERVE, each missing chunk written with its keys as if at 0, ENGINE_COMMIT."""
        kv, n_full = _as_mapped(local), len(tokens) // cs
        rope.params.check_span(position, n_full * cs)
        slots = token_slots(blocks, kv.block_size, kv.num_blocks, n_full * cs)
        total = StoreCounts(n_full, 0, 0, 0, 0)
        for first in range(0, n_full, MAX_POOL_CHUNKS):
            batch = tokens[first * cs : (first + MAX_POOL_CHUNKS) * cs]
            r = send(
                BlendReserve(
                    self.instance_id, self.secret, batch, None if ctx is None else ctx.window(first * cs)
                )
            )

            def write(c: int, buf: torch.Tensor) -> None:
                rope.into_chunk(kv, slots[c * cs : (c + 1) * cs], buf, position + c * cs, cs, splitter)

            stored = self._write_reserved(send, r, first, write)
            total = total.plus(stored, r.present, r.rejected, r.skipped)
        return total

    def retrieve_blend(
        self,
        send: Send,
        rope: WorkerRope,
        local: LocalKV,
        tokens: np.ndarray,
        blocks: np.ndarray,
        position: int,
        cs: int,
        splitter: CopySplitter,
        ctx: KeyContext | None = None,
    ) -> list[tuple[int, bool]]:
        """BLEND_ACQUIRE, each held chunk copied out with its keys rotated, ENGINE_RELEASE."""
        kv, n_full = _as_mapped(local), len(tokens) // cs
        rope.params.check_span(position, n_full * cs)
        slots = token_slots(blocks, kv.block_size, kv.num_blocks, n_full * cs)
        hits: list[tuple[int, bool]] = []
        for first in range(0, n_full, MAX_POOL_CHUNKS):
            batch = tokens[first * cs : (first + MAX_POOL_CHUNKS) * cs]
            r = send(
                BlendAcquire(
                    self.instance_id, self.secret, batch, None if ctx is None else ctx.window(first * cs)
                )
            )
            cb = r.slot_bytes
            self.toucher.want(max((off + cb for _, off in r.chunks), default=0), r.usable)
            with self._lease(send, r.lease, commit=False):
                for idx, off in r.chunks:
                    c = first + idx
                    if off >= 0:
                        chunk = slots[c * cs : (c + 1) * cs]
                        rope.out_of_chunk(
                            self.arena[off : off + cb], kv, chunk, position + c * cs, cs, splitter
                        )
                    hits.append((c, off >= 0))
        return hits

    def _write_reserved(
        self, send: Send, r: Reserved, first: int, write: Callable[[int, torch.Tensor], None]
    ) -> int:
        """``write(chunk, buffer)`` for every buffer a reserve handed out (chunk ``first`` + its
        index), then commit; the chunks stored."""
        cb = r.slot_bytes
        self.toucher.want(max((off + cb for _, off in r.slots), default=0), r.usable)
        every = max(1, COMMIT_EVERY_BYTES // max(cb, 1))
        with self._lease(send, r.lease, commit=True) as done:
            written = 0  # written and not yet committed
            for n, (idx, off) in enumerate(r.slots):
                self.toucher.ensure(off, off + cb)
                write(first + idx, self.arena[off : off + cb])
                written += 1
                if written == every and n + 1 < len(r.slots):  # the rest still to write
                    try:
                        done[0] += send(EngineCommit(self.instance_id, self.secret, r.lease, written)).stored
                    except RequestError as exc:  # the instance was released mid-copy
                        raise RequestAborted(f"lease {r.lease} lost mid-copy: {exc}") from None
                    written = 0
        return done[0]

    @contextlib.contextmanager
    def _lease(self, send: Send, lease: int, commit: bool) -> Iterator[list[int]]:
        """Commit (a reserve) or release (an acquire) once the copies are done, the chunks the
        commit stored in the yielded cell; on a failure release at once (best effort: a server
        that is gone drops the lease with the instance)."""
        done = [0]
        try:
            yield done
        except BaseException:
            with contextlib.suppress(KVWardenError):
                send(EngineRelease(self.instance_id, self.secret, lease))
            raise
        try:
            if commit:
                done[0] += send(EngineCommit(self.instance_id, self.secret, lease)).stored
            else:
                send(EngineRelease(self.instance_id, self.secret, lease))
        except RequestError as exc:  # the instance was released mid-copy (reaped, re-registered)
            # what was written is not published, and what was read may have changed under it
            raise RequestAborted(f"lease {lease} lost mid-copy: {exc}") from None
