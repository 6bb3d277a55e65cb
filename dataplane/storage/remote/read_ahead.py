"""The remote tier's read-ahead: GETs queued by a LOOKUP (or a RETRIEVE) and run one after
another on the thread ``kvwarden-remote-reader`` (start/stop/join), each answering a callback.

At most `READ_AHEAD_MAX` reads wait; a read refused past that is made when it is wanted. A
read never kills the thread: whatever it raises is answered None. ``stop`` answers nothing
more; ``join`` answers None to every read still waiting, so no caller waits for a read that
will not come. ``_cond`` guards ``_reads`` and ``_stopped`` (a leaf lock).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

READ_AHEAD_MAX = 256  # reads queued for the reader thread; more are refused (read when wanted)

Then = Callable[[memoryview | None], None]  # what a queued read hands its answer to
Alloc = Callable[[int], memoryview | None]
GiveBack = Callable[[memoryview], None]
# the read: (key, dtype, shape, alloc, give_back, scope) -> the payload (`RemoteBackend.get`)
Get = Callable[[bytes, str, Sequence[int] | None, Alloc | None, GiveBack | None, bytes], memoryview | None]


class LaterRead(NamedTuple):
    key: bytes
    dtype: str
    shape: tuple[int, ...] | None
    then: Then
    alloc: Alloc | None
    give_back: GiveBack | None
    scope: bytes = b""  # the scope the chunk is named in (`RemoteBackend.redis_key`)


class ReadAhead:
    def __init__(self, get: Get) -> None:
        self._get = get
        self._cond = threading.Condition()  # leaf: guards _reads and _stopped
        self._reads: collections.deque[LaterRead] = collections.deque()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvwarden-remote-reader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            left, self._reads = list(self._reads), collections.deque()
        for r in left:
            r.then(None)

    def add(self, read: LaterRead) -> bool:
        """Queue ``read``; False (its ``then`` never called): stopped, or full."""
        with self._cond:
            if self._stopped or len(self._reads) >= READ_AHEAD_MAX:
                return False
            self._reads.append(read)
            self._cond.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._reads or self._stopped)
                if self._stopped:
                    return  # (join answers what is left)
                r = self._reads.popleft()
            try:
                payload = self._get(r.key, r.dtype, r.shape, r.alloc, r.give_back, r.scope)
            except Exception:  # the reader never dies of one read (get counts Redis's failures)
                payload = None
            r.then(payload)
