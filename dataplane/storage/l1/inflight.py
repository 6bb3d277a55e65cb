"""Chunks being stored now: handed to a writer (a worker's one-copy reserve, the server's own
copy of a STORE), not yet committed. A LOOKUP counts them as pending (``pending_tokens``), so a
scheduler may hold a request back for a prefix that is about to land instead of recomputing it.

Each store opens a mark over the keys it will write. A key leaves its mark when it lands
(committed, or its write dropped); the mark ends with its store (the last commit, an abort, a
failure, an expired lease). A mark remembers the connection its request came over: when that
connection closes (a worker killed mid-store) its marks end at once, although the instance
itself is reaped only after the disconnect grace, so nothing waits on a store that will not
come. A store that still commits after that only publishes its chunks.

``_lock`` guards ``_count``, ``_marks`` and ``_next``; it is a leaf lock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence


class InFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _count, _marks, _next
        self._count: dict[bytes, int] = {}  # key -> marks holding it
        self._marks: dict[int, tuple[int, set[bytes]]] = {}  # mark -> (connection, keys left)
        self._next = itertools.count(1)

    def open(self, keys: Sequence[bytes], conn_fd: int = -1) -> int:
        """A store of ``keys`` starts over connection ``conn_fd`` (-1: none known); its mark
        (0, a mark that holds nothing, when ``keys`` is empty)."""
        if not keys:
            return 0
        with self._lock:
            mark = next(self._next)
            left = set(keys)
            self._marks[mark] = (conn_fd, left)
            for k in left:
                self._count[k] = self._count.get(k, 0) + 1
        return mark

    def landed(self, mark: int, keys: Sequence[bytes]) -> None:
        """These keys of ``mark`` are committed or dropped: no longer pending through it."""
        with self._lock:
            held = self._marks.get(mark)
            if held is None:
                return
            for k in keys:
                if k in held[1]:
                    held[1].discard(k)
                    self._drop(k)

    def end(self, mark: int) -> None:
        """The store of ``mark`` is over: whatever it did not land is not coming."""
        with self._lock:
            held = self._marks.pop(mark, None)
            if held is not None:
                for k in held[1]:
                    self._drop(k)

    def on_connection(self, conn_fd: int, connected: bool) -> None:
        """A connection listener (loop thread): a closed connection's marks end."""
        if connected:
            return
        with self._lock:
            gone = [m for m, (fd, _) in self._marks.items() if fd == conn_fd]
            for m in gone:
                for k in self._marks.pop(m)[1]:
                    self._drop(k)

    def run(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` are being stored."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._count:
                    break
                n += 1
        return n

    def chunks(self) -> int:
        """Keys being stored now (each counted once)."""
        with self._lock:
            return len(self._count)

    def stores(self) -> int:
        """Stores in flight (open marks)."""
        with self._lock:
            return len(self._marks)

    def _drop(self, k: bytes) -> None:
        n = self._count[k] - 1
        if n:
            self._count[k] = n
        else:
            del self._count[k]
