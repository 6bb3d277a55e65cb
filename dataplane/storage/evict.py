"""Eviction orders besides LRU (which is the order of L1's, and the file tier's, own table), for
L1 (`l1_eviction`) and the file tier (`fs_eviction`, `dataplane.storage.fs.index`).

``lfuda``: least frequently used with dynamic ageing (GreedyDual with a chunk's reads as its
worth). A chunk's priority is ``age + reads``: ``age`` is the priority of the last chunk evicted
at the time the chunk was last used, ``reads`` how many RETRIEVEs found it (its store counts
one; they count up to `MAX_READS`). The lowest priority goes first (the least recently used
among equals), and ``age`` becomes its priority, so a chunk read often long ago is overtaken by
one read once lately.
A LOOKUP or a STORE that finds a chunk refreshes its priority to the current age without
counting a read. The reads of chunks that left are remembered (`GHOST_PER_CHUNK` of them per
chunk held, by a hash of the key, the oldest forgotten first): a chunk stored again comes back
with them. Measured on the public Mooncake traces (BENCHMARKS.md "Hit rate on real traces"),
it keeps more of the prefixes used again than LRU, without reaching the optimum.

A heap with lazy deletion: O(log n) a use, an eviction pops the stale entries it meets; the
heap is rebuilt when stale entries outnumber live ones. The caller locks.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from collections.abc import Callable

GHOST_PER_CHUNK = 8  # read counts of chunks gone, remembered per chunk held
MAX_READS = 4  # a chunk's worth stops growing here: an old favourite cannot outlast the age


class Eviction(enum.StrEnum):
    LRU = "lru"
    LFUDA = "lfuda"


POLICIES = tuple(p.value for p in Eviction)


class LRUOrder:
    """LRU: L1's table of chunks is kept in that order itself; nothing to add here."""

    name = "lru"

    def added(self, key: bytes) -> None:
        pass

    def used(self, key: bytes, read: bool) -> None:
        pass

    def removed(self, key: bytes) -> None:
        pass


class LFUDAOrder:
    name = "lfuda"

    def __init__(self, ghosts_per_chunk: int = GHOST_PER_CHUNK) -> None:
        self.ghosts_per_chunk = ghosts_per_chunk
        self.age = 0.0
        self._seq = 0
        self._reads: dict[bytes, int] = {}
        self._live: dict[bytes, tuple[float, int]] = {}  # key -> its current (priority, seq)
        self._heap: list[tuple[float, int, bytes]] = []
        self._ghost: OrderedDict[int, int] = OrderedDict()  # hash(key) -> reads, of chunks gone

    def __len__(self) -> int:
        return len(self._live)

    def added(self, key: bytes, cold: bool = False) -> None:
        """A chunk committed: one read's worth, and what it was read before it left, if known.
        A ``cold`` one (found on disk, its use unknown) has none: it goes before any chunk used."""
        self._reads[key] = min(MAX_READS, (not cold) + self._ghost.pop(hash(key), 0))
        self._push(key)

    def used(self, key: bytes, read: bool) -> None:
        """A chunk found: by a RETRIEVE (``read``) or by a LOOKUP or STORE (refreshed only)."""
        if key not in self._reads:
            return
        self._reads[key] = min(MAX_READS, self._reads[key] + read)
        self._push(key)

    def removed(self, key: bytes) -> None:
        """A chunk gone (evicted, discarded, cleared): its heap entries are stale from now; its
        reads are remembered."""
        reads = self._reads.pop(key, None)
        self._live.pop(key, None)
        if reads is not None:
            self._ghost[hash(key)] = reads
            while len(self._ghost) > self.ghosts_per_chunk * max(1, len(self._live)):
                self._ghost.popitem(last=False)

    def victim(self, evictable: Callable[[bytes], bool]) -> bytes | None:
        """The lowest-priority chunk ``evictable`` allows (it is then removed, and the age rises
        to its priority); None when there is none. Chunks passed over stay as they were."""
        passed: list[tuple[float, int, bytes]] = []
        found: bytes | None = None
        while self._heap:
            item = heapq.heappop(self._heap)
            prio, seq, key = item
            if self._live.get(key) != (prio, seq):
                continue  # stale: used again since, or gone
            if evictable(key):
                found = key
                self.age = prio
                self.removed(key)
                break
            passed.append(item)
        for item in passed:
            heapq.heappush(self._heap, item)
        return found

    def _push(self, key: bytes) -> None:
        self._seq += 1
        entry = (self.age + self._reads[key], self._seq)
        self._live[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._live) + 1024:
            self._heap = [(p, s, k) for k, (p, s) in self._live.items()]
            heapq.heapify(self._heap)
