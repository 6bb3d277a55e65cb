"""Trace replay, simulated: the hit rate of a cache of ``capacity`` chunks under a policy.

It follows what a kvwarden server does with each request of a replay (`kvbench.trace`), so that
the replay through the real server can be held to it:

1. LOOKUP: the prefix of the request's *full* blocks that is held (a partial last block has no
   chunk key and is never stored); each held block is used now.
2. RETRIEVE of that prefix: used again (no change of order).
3. STORE of every full block: those held are pinned and used now (in order), then each missing
   one is inserted, evicting an unpinned block the policy picks; with every block pinned the
   rest of the request is not stored.

Policies: ``lru`` and ``lfuda`` (kvwarden's L1 under ``l1_eviction``: the LOOKUP refreshes the
held prefix, the RETRIEVE counts a read of each, the STORE refreshes what is present, in the
server's own `dataplane.storage.evict` order) and ``optimum``, offline Belady/MIN with bypass: the block
used again furthest in the future is evicted (or the new block not admitted, when it is that
block), ties evicting the deeper block so the cache stays prefix-closed. It is a bound no
online policy reaches, simulated only.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from dataplane.storage.evict import LFUDAOrder
from kvbench.trace_data import BLOCK_TOKENS, TraceRequest

NEVER = 1 << 62


@dataclass
class SimResult:
    requests: int
    blocks: int  # full blocks asked for
    hit_blocks: int
    tokens: int  # prompt tokens asked for
    hit_tokens: int
    evictions: int

    @property
    def block_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0


def simulate(reqs: Sequence[TraceRequest], capacity: int, policy: str = "lru") -> SimResult:
    """The replay of ``reqs`` through a cache of ``capacity`` chunks."""
    if policy == "lru":
        return _replay(reqs, capacity, _LRU())
    if policy == "lfuda":
        return _replay(reqs, capacity, _LFUDA())
    if policy == "optimum":
        return _optimum(reqs, capacity)
    raise ValueError(f"policy {policy!r}: lru, lfuda or optimum")


def _count(r: TraceRequest, held: int, res: SimResult) -> None:
    res.requests += 1
    res.blocks += r.full_blocks
    res.hit_blocks += held
    res.tokens += r.input_length
    res.hit_tokens += held * BLOCK_TOKENS


class _LRU:
    """LRU over block ids: L1's own table order (a use moves a block to the end)."""

    def __init__(self) -> None:
        self._order: collections.OrderedDict[int, None] = collections.OrderedDict()

    def used(self, b: int, read: bool) -> None:
        self._order.move_to_end(b)

    def added(self, b: int) -> None:
        self._order[b] = None

    def victim(self, pinned: set[int]) -> int | None:
        v = next((k for k in self._order if k not in pinned), None)
        if v is not None:
            del self._order[v]
        return v


class _LFUDA:
    """The server's own `LFUDAOrder`, over block ids."""

    def __init__(self) -> None:
        self._order = LFUDAOrder()

    def used(self, b: int, read: bool) -> None:
        self._order.used(_k(b), read)

    def added(self, b: int) -> None:
        self._order.added(_k(b))

    def victim(self, pinned: set[int]) -> int | None:
        v = self._order.victim(partial(_unpinned, pinned))
        return None if v is None else int.from_bytes(v)


def _replay(reqs: Sequence[TraceRequest], capacity: int, order: _LRU | _LFUDA) -> SimResult:
    """The server's sequence of touches, pins and evictions, in ``order``."""
    cache: set[int] = set()
    res = SimResult(0, 0, 0, 0, 0, 0)
    for r in reqs:
        full = r.hash_ids[: r.full_blocks]
        held = 0
        for b in full:
            if b not in cache:
                break
            held += 1
        _count(r, held, res)
        for read in (False, True):  # LOOKUP, then RETRIEVE
            for b in full[:held]:
                order.used(b, read)
        pinned = {b for b in full if b in cache}
        for b in full:
            if b in pinned:
                order.used(b, False)  # the STORE finds it
        for b in full:
            if b in cache:
                continue
            if len(cache) >= capacity:
                victim = order.victim(pinned)
                if victim is None:
                    break  # all pinned: the rest is not stored
                cache.discard(victim)
                res.evictions += 1
            cache.add(b)
            order.added(b)
            pinned.add(b)
    return res


def _unpinned(pinned: set[int], k: bytes) -> bool:
    return int.from_bytes(k) not in pinned


def _k(b: int) -> bytes:
    return b.to_bytes(8)


def _next_uses(reqs: Sequence[TraceRequest]) -> list[list[int]]:
    """For each request and each of its full blocks: the index of the next request that asks
    for that block (`NEVER`: none)."""
    last: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in reqs]
    for i in range(len(reqs) - 1, -1, -1):
        full = reqs[i].hash_ids[: reqs[i].full_blocks]
        out[i] = [last.get(b, NEVER) for b in full]
        for b in full:
            last[b] = i
    return out


def _optimum(reqs: Sequence[TraceRequest], capacity: int) -> SimResult:
    nxt = _next_uses(reqs)
    cache: dict[int, tuple[int, int]] = {}  # block -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block): furthest first, deeper first
    res = SimResult(0, 0, 0, 0, 0, 0)
    for i, r in enumerate(reqs):
        full = r.hash_ids[: r.full_blocks]
        held = 0
        for b in full:
            if b not in cache:
                break
            held += 1
        _count(r, held, res)
        for depth, (b, n) in enumerate(zip(full, nxt[i], strict=True)):
            cache[b] = (n, depth)
            heapq.heappush(heap, (-n, -depth, b))
        while len(cache) > capacity:
            n, d, b = heapq.heappop(heap)
            if cache.get(b) == (-n, -d):
                del cache[b]
                res.evictions += 1
    return res
