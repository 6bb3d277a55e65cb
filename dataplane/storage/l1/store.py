"""L1: a byte-bounded local CPU chunk store, its buffers carved from one arena, evicting the least
recently used chunk (``policy="lru"``) or by `dataplane.storage.evict`'s order (``"lfuda"``).

Writes are two-phase: ``reserve`` hands out a buffer (evicting least-recently-used chunks that
no reader holds), the caller copies into it outside any lock, then ``commit`` publishes it (or
``abort`` returns it). Readers ``acquire`` a prefix of chunks, which pins them against eviction,
copy out, then ``release``. Every buffer is a view of the arena (`dataplane.storage.l1.arena`):
memory reserved and faulted in at start, so no copy pays a page fault per page.

Accounting is exact: ``used_bytes`` is committed plus reserved chunk bytes, at most
``capacity_bytes``, and so is each tenant's (`dataplane.storage.l1.tenants`: a reserve names the
tenant its chunk is for; with a share, a tenant at its share evicts only its own chunks). While
a shared arena is still reserving its space (the first seconds of a big one), a reserve that
does not fit in what is ready waits for it, within a bound.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dataplane.events.describe import NameBook
from dataplane.events.sink import NO_EVENTS, EventSink
from dataplane.events.vllm_format import MEDIUM_CPU
from dataplane.storage.evict import POLICIES, LFUDAOrder, LRUOrder
from dataplane.storage.keys import ScopeMatch
from dataplane.storage.l1.arena import Arena, Extents
from dataplane.storage.l1.clears import ClearBook
from dataplane.storage.l1.inflight import InFlight
from dataplane.storage.l1.stats import L1Stats, ScopeCleared
from dataplane.storage.l1.tenants import NO_TENANT, TenantBook

_WAIT_FOR_ARENA_S = 10.0  # longest a reserve waits for the arena to grow
_HEADROOM = 256 << 20  # the arena's fault-in steps aside for copies while this much is ready
# the arena is kept ready this far beyond what L1 holds, and grows further only as L1 fills: the
# whole of it at once cost a fresh server's first requests a quarter more time to first token
# (a 4 GiB L1 on 2 cores, vLLM's OpenAI server, bench serve)
GROW_AHEAD = 512 << 20
CLEAR_WAIT_S = 10.0  # longest a clear waits for the readers of its chunks
QUARANTINE_S = 60.0  # how long a buffer a worker may still write into is kept out of use


@dataclass
class _Entry:
    buf: torch.Tensor
    offset: int  # in the arena
    readers: int = 0
    tenant: bytes = NO_TENANT
    scope: bytes = b""  # the key's scope (`clear_scope` removes a scope's chunks)


class L1Store:
    def __init__(
        self,
        capacity_bytes: int,
        hot_cache: bool = True,
        arena: Arena | None = None,
        clock: Callable[[], float] = time.monotonic,
        tenant_share_bytes: int | None = None,
        policy: str = "lru",
        grow_ahead: int = GROW_AHEAD,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError("L1 capacity must be > 0")
        if policy not in POLICIES:
            raise ValueError(f"eviction policy {policy!r}: one of {', '.join(POLICIES)}")
        self.capacity_bytes = capacity_bytes
        self.hot_cache = hot_cache
        # without one given: a private arena faulted on first use (tests, small stores)
        self.arena = arena if arena is not None else Arena(capacity_bytes, shared=False, prefault=False)
        # _lock guards every field below and the allocator; it is a leaf lock: no copy, no
        # allocation and no call into the arena (which has its own lock) runs under it
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._order = LFUDAOrder() if policy == "lfuda" else LRUOrder()  # (LRU: the table's order)
        self._free = Extents()
        self._known_usable = 0  # arena bytes handed to _free so far
        self._used = 0
        self._pinned = 0  # bytes of chunks some reader holds
        self._evictions = 0
        self._share_evictions = 0
        self._hits = 0
        self._rejected = 0
        self._writing = 0  # buffers reserved and not yet committed or aborted
        self._waiting = 0  # reserves waiting for the arena to grow
        self._clock = clock
        self._quarantined: list[tuple[float, torch.Tensor]] = []  # (until when, buffer)
        self._tenants = TenantBook(tenant_share_bytes)
        self._reserved_for: dict[int, bytes] = {}  # offset of a reserved buffer -> its tenant
        # clears (`clear_scope`): a chunk whose bytes were produced before its scope's clear
        # began, or that commits while one runs, is refused (`commit`); _cleared notifies the
        # waits for the readers of a scope being cleared
        self._reserved_at: dict[int, int] = {}  # offset of a reserved buffer -> the epoch then
        self._clears = ClearBook()
        self._cleared = threading.Condition(self._lock)
        self.arena.yield_to = self._copying_with_room
        self.arena.needed = self._growth_needed
        self.grow_ahead = grow_ahead  # bytes of the arena kept ready beyond what L1 holds
        self.inflight = InFlight()  # chunks being written, not yet committed (lookups see them)
        # KV events (`dataplane.events`): told of every chunk committed and dropped, under _lock
        # (a report never waits), so their order is the order of the changes
        self.events: EventSink = NO_EVENTS
        self.names = NameBook()  # what the engine's names of blocks tell a router's lookup

    # ---------------------------------------------------------------- reads
    def prefix_hits(self, keys: list[bytes], scope: bytes = b"", tenant: bytes = NO_TENANT) -> int:
        """How many leading keys are present (refreshes their LRU position). ``scope``: the
        keys' scope, ``tenant``: who asks (for the lower tiers of `TieredStore`)."""
        n = 0
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is None:
                    break
                self._entries.move_to_end(k)
                self._tenants.touched(e.tenant, k, hit=False)
                self._order.used(k, read=False)
                n += 1
        return n

    def prefix_split(
        self, keys: list[bytes], scope: bytes = b"", tenant: bytes = NO_TENANT
    ) -> tuple[int, int, int]:
        """`prefix_hits` by tier: (L1's, the file tier's, the remote tier's): L1 has no other."""
        return self.prefix_hits(keys, scope, tenant), 0, 0

    def peek_prefix(self, keys: list[bytes]) -> int:
        """How many leading keys are present, touching nothing (a router's question)."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._entries:
                    break
                n += 1
        return n

    def acquire_prefix(
        self, keys: list[bytes], tenant: bytes = NO_TENANT, scope: bytes = b""
    ) -> list[torch.Tensor]:
        """Pin and return the buffers of the longest present prefix of ``keys`` (L1's hits;
        ``tenant``: who asks, should a lower tier bring chunks in for it; ``scope``: theirs)."""
        return self._pin_prefix(keys, hits=True)

    def _pin_prefix(self, keys: list[bytes], hits: bool) -> list[torch.Tensor]:
        """`acquire_prefix`; not ``hits``: a lower tier just brought them in (its hits)."""
        out: list[torch.Tensor] = []
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is None:
                    break
                self._pin(e)
                self._entries.move_to_end(k)
                self._tenants.touched(e.tenant, k, hit=True)
                self._order.used(k, read=hits)
                out.append(e.buf)
            self._hits += len(out) if hits else 0
        return out

    def _count_hits(self, keys: list[bytes]) -> None:
        with self._lock:
            self._hits += len(keys)
            for k in keys:
                self._order.used(k, read=True)

    def acquire_into(
        self,
        keys: list[bytes],
        into: Callable[[int, int], Sequence[memoryview] | None],
        tenant: bytes = NO_TENANT,
        scope: bytes = b"",
        later: Callable[[Callable[[], None]], None] | None = None,
        nbytes: int | None = None,
    ) -> list[torch.Tensor | None]:
        """`acquire_prefix` for a caller that could take chunks in place (``into``, ``later``,
        ``nbytes``: `TieredStore.acquire_into`, which reads files so); L1 alone places none."""
        return list(self.acquire_prefix(keys, tenant, scope))

    def release(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None and e.readers > 0:
                    e.readers -= 1
                    if e.readers == 0:
                        self._pinned -= e.buf.numel()
                        if self._clears.running:
                            self._cleared.notify_all()

    def pin_present(self, keys: list[bytes]) -> tuple[list[int], list[bytes]]:
        """Pin every present key (a writer protects a prompt's own chunks from its later
        reserves); returns (indices missing, keys pinned) — ``release`` the latter."""
        missing: list[int] = []
        pinned: list[bytes] = []
        with self._lock:
            for i, k in enumerate(keys):
                e = self._entries.get(k)
                if e is None:
                    missing.append(i)
                    continue
                self._pin(e)
                self._entries.move_to_end(k)
                self._tenants.touched(e.tenant, k, hit=False)
                self._order.used(k, read=False)
                pinned.append(k)
        return missing, pinned

    # --------------------------------------------------------------- writes
    def reserve(self, nbytes: int, tenant: bytes = NO_TENANT) -> torch.Tensor | None:
        """A buffer of ``nbytes`` for ``tenant``'s chunk, counted as used, or None when L1
        cannot take it now. A tenant at its share makes room by evicting its own chunks."""
        while True:
            usable, grown = self.arena.growth()
            with self._lock:
                if nbytes > self.capacity_bytes - self._pinned or not self._within_share(tenant, nbytes):
                    self._rejected += 1  # could never fit: evict nothing (of anyone else's)
                    return None
                self._grow(usable)
                self._end_quarantine()
                # while the arena still grows, wait for it rather than evict chunks to make room
                off = self._alloc(nbytes, may_evict=grown)
                if off is None and grown:
                    self._rejected += 1
                    return None
                if off is not None:
                    self._used += nbytes
                    self._writing += 1
                    self._reserved_for[off] = tenant
                    self._reserved_at[off] = self._clears.epoch
                    self._tenants.add_bytes(tenant, nbytes)
            if off is not None:
                self.arena.nudge()  # it may need to grow (outside the lock: the arena has its own)
                return self.arena.view(off, nbytes)
            with self._lock:
                self._waiting += 1
            self.arena.nudge()
            try:
                grew = self.arena.wait_usable(usable, _WAIT_FOR_ARENA_S)  # still being reserved
            finally:
                with self._lock:
                    self._waiting -= 1
            if not grew and not self.arena.growth()[1]:
                with self._lock:
                    self._rejected += 1
                return None  # (when growth just ended short, the next turn may evict instead)

    def commit(
        self,
        key: bytes,
        buf: torch.Tensor,
        pin: bool = False,
        scope: bytes = b"",
        since: int | None = None,
        words: str | None = None,
    ) -> bool:
        """Publish a reserved buffer; False (buffer returned) when the key was already present,
        or when its scope was cleared since its bytes were produced (``since``: the `epoch`
        when they began to be read; else when the buffer was reserved) or is being cleared now:
        then nothing is pinned. With ``pin`` the chunk stays pinned (whichever copy won) until
        ``release``; ``scope``: the key's scope (where a lower tier of `TieredStore` files it); ``words``: the
        dtype of its elements (which a lower tier may code: `dataplane.storage.compress`)."""
        with self._lock:
            self._writing -= 1
            off = self.arena.offset_of(buf)
            tenant = self._reserved_for.pop(off, NO_TENANT)
            at = self._reserved_at.pop(off, self._clears.epoch)
            if self._clears.stale(scope, at if since is None else since):
                self._give_back(buf)  # stale: KV of before the clear
                self._tenants.add_bytes(tenant, -buf.numel())
                return False
            e = self._entries.get(key)
            written = e is None
            if e is None:
                e = self._entries[key] = _Entry(buf, off, tenant=tenant, scope=scope)
                self._tenants.committed(tenant, key)
                self._order.added(key)
                self.events.stored(key, MEDIUM_CPU)
            else:
                self._give_back(buf)
                self._tenants.add_bytes(tenant, -buf.numel())
            if pin:
                self._pin(e)
            return written

    def abort(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._writing -= 1
            self._unreserve(buf)
            self._give_back(buf)

    def quarantine(self, buf: torch.Tensor) -> None:
        """Like ``abort``, for a buffer someone may still write into (a worker reaped mid-copy):
        its bytes stay counted and out of use for ``QUARANTINE_S``, then return."""
        with self._lock:
            self._writing -= 1
            self._unreserve(buf)  # no tenant's any more; L1's until the quarantine ends
            self._quarantined.append((self._clock() + QUARANTINE_S, buf))

    def writable(self) -> bool:
        """Whether STORE may write now (`TieredStore` asks the health monitor)."""
        return True

    def discard(self, keys: list[bytes]) -> int:
        """Drop those of ``keys`` that are present and that no reader holds; how many."""
        with self._lock:
            n = 0
            for k in keys:
                e = self._entries.get(k)
                if e is not None and e.readers == 0:
                    self._drop(k, self._entries.pop(k))
                    n += 1
            return n

    def clear(self) -> int:
        """Drop every chunk no reader holds; returns how many were dropped."""
        with self._lock:
            victims = [k for k, e in self._entries.items() if e.readers == 0]
            for k in victims:
                self._drop(k, self._entries.pop(k))
            return len(victims)

    def epoch(self) -> int:
        """Clears begun so far: a lower tier's read notes it before it starts, and its commit
        passes it (``since``), so bytes read from before a clear never enter L1 after it."""
        with self._lock:
            return self._clears.epoch

    def begin_clear(self, scope: ScopeMatch) -> None:
        """A clear of the chunks ``scope`` matches (their filing scopes: `dataplane.storage.keys`)
        starts: from now until `end_clear`, none of them commits, and none whose bytes were
        produced before now ever will. (`TieredStore` clears its lower tiers in between, so
        nothing read from them before they were cleared enters L1.)"""
        if not scope.head:
            raise ValueError("a clear names a scope")
        with self._lock:
            self._clears.begin(scope)

    def end_clear(self, scope: ScopeMatch, wait_s: float) -> tuple[int, int]:
        """Drop every chunk of ``scope`` (KV events announce each), waiting at most ``wait_s``
        for the readers of those that are pinned (a copy out under way, a write-behind); ends
        what `begin_clear` began. (chunks dropped, chunks still pinned at the deadline: those
        stay, the clear incomplete.)"""
        deadline = time.monotonic() + wait_s  # (a real wait: not the injected clock)
        dropped = 0
        with self._lock:
            try:
                # found once (none of the scope commits meanwhile): a wake-up rechecks the pinned
                held = [(k, e) for k, e in self._entries.items() if scope.matches(e.scope)]
                while True:
                    live = [(k, e) for k, e in held if self._entries.get(k) is e]  # (not evicted)
                    held = [(k, e) for k, e in live if e.readers]
                    for k, e in live:
                        if not e.readers:
                            del self._entries[k]
                            self._drop(k, e)
                            dropped += 1
                    now = time.monotonic()
                    if not held or now >= deadline:
                        return dropped, len(held)
                    self._cleared.wait(deadline - now)  # (a release notifies)
            finally:
                self._clears.end(scope)

    def clear_scope(self, scope: ScopeMatch, wait_s: float = CLEAR_WAIT_S) -> ScopeCleared:
        """Remove every chunk ``scope`` matches (`begin_clear`, then `end_clear`): what a reset
        of the model's cache asks (weights changed: its KV is stale)."""
        self.begin_clear(scope)
        dropped, left = self.end_clear(scope, wait_s)
        return ScopeCleared(dropped, pinned=left)

    def set_hot_cache(self, on: bool) -> None:
        with self._lock:
            self.hot_cache = on

    def stats(self) -> L1Stats:
        arena = self.arena.stats()
        inflight = (self.inflight.chunks(), self.inflight.stores())
        with self._lock:
            return L1Stats(
                self._used,
                self.capacity_bytes,
                len(self._entries),
                self.hot_cache,
                self._evictions,
                self._rejected,
                arena,
                self._free.fragmentation(),
                self._tenants.top(),
                self._tenants.share_bytes,
                *inflight,
                self._hits,
                self._share_evictions,
                self._order.name,
            )

    def close(self) -> None:
        """Drop every chunk and the arena (no reader may hold a buffer any more)."""
        with self._lock:
            self._entries.clear()
        self.arena.close()

    def _growth_needed(self, ready: int) -> bool:
        """Whether the arena's fault-in should go on past ``ready`` bytes now: a reserve waits
        for it, or less than ``grow_ahead`` of them is free. Read without the lock: a hint."""
        return self._waiting > 0 or ready - self._used < self.grow_ahead

    def _copying_with_room(self, usable: int) -> bool:
        """Whether copies run now and the usable part of the arena has room to spare for them
        (the arena's fault-in steps aside then). Read without the lock: a hint, not a fact."""
        if self._waiting:  # a reserve needs more of the arena: never step aside then
            return False
        return (self._writing > 0 or self._pinned > 0) and usable - self._used > _HEADROOM

    # ------------------------------------------------------- lock held below
    def _pin(self, e: _Entry) -> None:
        if e.readers == 0:
            self._pinned += e.buf.numel()
        e.readers += 1

    def _end_quarantine(self) -> None:
        now = self._clock()
        if self._quarantined and min(until for until, _ in self._quarantined) < now:
            done = [b for until, b in self._quarantined if until < now]
            self._quarantined = [(until, b) for until, b in self._quarantined if until >= now]
            for buf in done:
                self._give_back(buf)

    def _grow(self, usable: int) -> None:
        if usable > self._known_usable:
            self._free.free(self._known_usable, usable - self._known_usable)
            self._known_usable = usable

    def _alloc(self, nbytes: int, may_evict: bool) -> int | None:
        """An arena offset for ``nbytes``, evicting least-recently-used chunks until one fits."""
        while True:
            if self._used + nbytes <= self.capacity_bytes:
                off = self._free.alloc(nbytes)
                if off is not None:
                    return off
            if not may_evict or not self._evict_one():
                return None

    def _give_back(self, buf: torch.Tensor) -> None:
        self._used -= buf.numel()
        self._free.free(self.arena.offset_of(buf), buf.numel())

    def _unreserve(self, buf: torch.Tensor) -> None:
        self._reserved_at.pop(self.arena.offset_of(buf), None)
        tenant = self._reserved_for.pop(self.arena.offset_of(buf), NO_TENANT)
        self._tenants.add_bytes(tenant, -buf.numel())

    def _drop(self, key: bytes, e: _Entry, evicted: bool = False) -> None:
        self._used -= e.buf.numel()
        self._free.free(e.offset, e.buf.numel())
        self._tenants.dropped(e.tenant, key, e.buf.numel(), evicted)
        self._order.removed(key)
        self._evictions += evicted
        self.events.removed(key, MEDIUM_CPU)

    def _evict_one(self) -> bool:
        if isinstance(self._order, LFUDAOrder):
            k = self._order.victim(lambda k: self._entries[k].readers == 0)
            if k is None:
                return False
            self._drop(k, self._entries.pop(k), evicted=True)
            return True
        for k, e in self._entries.items():  # oldest first
            if e.readers == 0:
                del self._entries[k]
                self._drop(k, e, evicted=True)
                return True
        return False

    def _within_share(self, tenant: bytes, nbytes: int) -> bool:
        """Make room for ``nbytes`` more of ``tenant`` within its share, evicting its own least
        recently used chunks (no reader holding them); False, evicting nothing, when that
        cannot be enough."""
        need = self._tenants.excess(tenant, nbytes)
        if need <= 0:
            return True
        victims: list[tuple[bytes, _Entry]] = []
        for k in self._tenants.own_oldest(tenant):
            e = self._entries[k]
            if e.readers == 0:
                victims.append((k, e))
                need -= e.buf.numel()
                if need <= 0:
                    break
        if need > 0:
            return False
        for k, e in victims:
            del self._entries[k]
            self._drop(k, e, evicted=True)
        self._share_evictions += len(victims)
        return True
