"""EventSink: where the storage tiers and the modules report what changed, from any thread.

A report is one append to a bounded queue and never waits, nor wakes anyone: the caller may
hold a tier's lock (L1 reports under its own, so the order of its reports is the order of its
changes), and the publisher collects the reports every `PUBLISH_EVERY_S` (a wake-up per report
cost a STORE ~10% more here: the woken thread takes the GIL in the middle of the STORE). What does
not fit is dropped and counted; the publisher (`dataplane.events.publisher`) then tells its
subscribers ``AllBlocksCleared`` once it has caught up, and announces only what is stored from
then on, so a router that missed a withdrawal is never left believing a chunk is held.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from dataplane.events.vllm_format import ChunkMeta

DEFAULT_QUEUE = 1 << 17

Item = tuple[Any, ...]


class EventSink:
    enabled = True

    def __init__(self, max_queue: int = DEFAULT_QUEUE) -> None:
        self.max_queue = max_queue
        self._q: deque[Item] = deque()  # appended by any thread, popped by the publisher's
        self.dropped = 0  # reports that did not fit (read by the publisher's thread)

    def _put(self, item: Item) -> None:
        if len(self._q) >= self.max_queue:
            self.dropped += 1
            if len(self._q) < self.max_queue + 1:
                self._q.append(("overflow",))  # (one marker: the publisher clears after it)
        else:
            self._q.append(item)

    def describe(self, key: bytes, meta: ChunkMeta) -> None:
        self._put(("describe", key, meta))

    def stored(self, key: bytes, medium: str) -> None:
        self._put(("stored", key, medium))

    def removed(self, key: bytes, medium: str) -> None:
        self._put(("removed", key, medium))

    def removed_all(self, medium: str) -> None:
        self._put(("removed_all", medium))

    def cleared(self) -> None:
        self._put(("cleared",))

    def take(self, limit: int) -> list[Item]:
        """Up to ``limit`` reports, oldest first (the publisher's thread only)."""
        out: list[Item] = []
        q = self._q
        while q and len(out) < limit:
            out.append(q.popleft())
        return out

    def depth(self) -> int:
        return len(self._q)


class NullSink(EventSink):
    """Events off: every report is dropped on the floor, uncounted."""

    enabled = False

    def _put(self, item: Item) -> None:
        return None


NO_EVENTS = NullSink()
