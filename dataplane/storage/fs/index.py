"""What the file tier knows is on disk: key -> (scope, size), the bytes it adds up to, and the
order files leave in (`dataplane.storage.fs.tier` keeps one; its own lock, a leaf).

The order is ``lru`` (the table's own order: least recently used first) or ``lfuda``
(`dataplane.storage.evict.LFUDAOrder`, as L1's: least often read, aged). A read is a file read
whole (a RETRIEVE's, or the read-ahead of a LOOKUP that found it); its write, or a ``stat`` that
found a file the index did not know, puts it in the order with one read's worth, as a store does
in L1. The order lives in memory: after a restart the files start as the scan found them, the
least recently modified first, with no reads counted.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dataplane.storage.evict import POLICIES, LFUDAOrder
from dataplane.storage.fs.layout import ScannedFile

GHOSTS_PER_FILE = 1  # read counts of files gone, remembered per file held (lfuda)


@dataclass
class FileEntry:
    scope: bytes
    size: int  # the file's bytes (header included)


class FileIndex:
    def __init__(self, policy: str = "lru") -> None:
        if policy not in POLICIES:
            raise ValueError(f"eviction policy {policy!r}: one of {', '.join(POLICIES)}")
        self.policy = policy
        self._lock = threading.Lock()  # leaf: guards _files, _used and _order
        self._files: collections.OrderedDict[bytes, FileEntry] = collections.OrderedDict()
        self._used = 0
        self._order = LFUDAOrder(GHOSTS_PER_FILE) if policy == "lfuda" else None  # None: _files' order

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._files

    def sizes(self) -> tuple[int, int]:
        """(files, bytes)."""
        with self._lock:
            return len(self._files), self._used

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are known."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._files:
                    break
                n += 1
        return n

    def learn(self, scope: bytes, key: bytes, size: int, read: bool = False) -> None:
        """``key`` is on disk and was used now: read by a RETRIEVE (``read``), or found or
        written."""
        with self._lock:
            if key in self._files:
                self._files.move_to_end(key)
                if self._order is not None:
                    self._order.used(key, read)
                return
            self._files[key] = FileEntry(scope, size)
            self._used += size
            if self._order is not None:
                self._order.added(key)
                if read:
                    self._order.used(key, True)

    def forget(self, key: bytes) -> None:
        with self._lock:
            f = self._files.pop(key, None)
            if f is not None:
                self._used -= f.size
                if self._order is not None:
                    self._order.removed(key)

    def forget_scope(self, scope: bytes) -> list[bytes]:
        """Forget every key of ``scope``: those keys."""
        with self._lock:
            keys = [k for k, f in self._files.items() if f.scope == scope]
            for k in keys:
                self._used -= self._files.pop(k).size
                if self._order is not None:
                    self._order.removed(k)
        return keys

    def victims(self, room: int, capacity: int) -> list[tuple[bytes, FileEntry]]:
        """Take entries out, in the policy's order, until ``room`` more bytes fit in ``capacity``."""
        out: list[tuple[bytes, FileEntry]] = []
        with self._lock:
            while self._files and self._used + room > capacity:
                if self._order is None:
                    key, f = self._files.popitem(last=False)
                else:
                    k = self._order.victim(lambda _: True)
                    if k is None:  # (every known file has its entry: not reached)
                        break
                    key, f = k, self._files.pop(k)
                self._used -= f.size
                out.append((key, f))
        return out

    def merge(self, found: Iterable[ScannedFile]) -> None:
        """Match a scan: forget what it did not find, learn what it found that is not known (at
        the old end, the most recently modified last: their use here is unknown)."""
        found = sorted(found, key=lambda f: f.mtime, reverse=True)
        seen = {f.key for f in found}
        with self._lock:
            for gone in [k for k in self._files if k not in seen]:
                self._used -= self._files.pop(gone).size
                if self._order is not None:
                    self._order.removed(gone)
            new = [f for f in found if f.key not in self._files]
            for f in new:  # newest first, each to the old end: the oldest ends up first
                self._files[f.key] = FileEntry(f.scope, f.size)
                self._files.move_to_end(f.key, last=False)
                self._used += f.size
            if self._order is not None:  # oldest first, unread: before any file used here
                for f in reversed(new):
                    self._order.added(f.key, cold=True)
