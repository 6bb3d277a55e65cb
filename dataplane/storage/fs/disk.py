"""Disk calls with a deadline, off the caller's thread: the file tier's I/O threads.

A file system can stop answering (a network mount whose server is gone, a dying disk) and a
thread inside ``read()`` or ``open()`` then cannot be interrupted. So no thread that serves
requests makes a disk call itself: it hands the call to `DiskPool`, whose threads
(``kvwarden-fs-io-<i>``, start/stop/join) make it, and waits at most its deadline.

- `call` waits for the result up to the deadline; past it the call is *abandoned*
  (`DiskTimeout`): the caller goes on (a miss), and when the call returns at last its
  ``on_late`` cleans up what it produced (a buffer goes back to L1). A thread stuck in the
  kernel stays stuck; the pool never grows, so a dead mount costs at most its threads.
- `submit` runs a call nobody waits for (read-ahead); False when the pool is busy.
- Calls wait in a bounded queue: with ``max_pending`` already waiting, a call is refused at once
  (`DiskBusy`), so a stalled disk makes requests miss at once instead of queueing behind it.
- `stalled_for` is how long the oldest running call has run: the health check's view of a stall.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class DiskTimeout(Exception):
    """A disk call did not answer within its deadline (it was abandoned)."""


class DiskBusy(DiskTimeout):
    """Too many disk calls wait already: refused without waiting."""


@dataclass(eq=False)
class _Call(Generic[T]):
    fn: Callable[[], T]
    on_late: Callable[[T], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    abandoned: bool = False  # the caller gave up: the result is on_late's
    started: float = 0.0  # when a thread took it (0: waiting)


class DiskPool:
    def __init__(
        self,
        threads: int,
        timeout_s: float,
        max_pending: int = 256,
        name: str = "kvwarden-fs-io",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threads < 1 or timeout_s <= 0 or max_pending < 1:
            raise ValueError(
                f"threads, timeout_s and max_pending must be > 0, got {threads}, {timeout_s}, {max_pending}"
            )
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self._name = name
        self._n = threads
        self._clock = clock
        self._cond = threading.Condition(
            threading.Lock()
        )  # leaf: guards _queue, _running, _stopping, counters
        self._queue: collections.deque[_Call[Any]] = collections.deque()
        self._running: set[_Call[Any]] = set()
        self._stopping = False
        self.timeouts = 0
        self.refused = 0
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._threads:
            raise RuntimeError("DiskPool already started")
        for i in range(self._n):
            t = threading.Thread(target=self._run, name=f"{self._name}-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def stop(self) -> None:
        """Refuse new calls; those waiting are abandoned (their ``on_late`` runs here)."""
        with self._cond:
            self._stopping = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for c in waiting:
            c.abandoned = True
            c.error = DiskTimeout("the file tier is stopping")
            c.done.set()

    def join(self, timeout_s: float = 5.0) -> bool:
        """Wait for the threads (a thread stuck in the kernel is left behind: daemon)."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    @property
    def threads(self) -> int:
        return self._n

    def is_alive(self) -> bool:
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------------ calls
    def call(
        self, fn: Callable[[], T], on_late: Callable[[T], None] | None = None, timeout_s: float | None = None
    ) -> T:
        """``fn()`` on a pool thread, its exception re-raised here; `DiskTimeout` past the
        deadline (``on_late`` then gets the result, if any), `DiskBusy` when the queue is full."""
        return self.finish(self.begin(fn, on_late), self.timeout_s if timeout_s is None else timeout_s)

    def begin(self, fn: Callable[[], T], on_late: Callable[[T], None] | None = None) -> _Call[T]:
        """`call` in two steps: start ``fn()`` on a pool thread now (`DiskBusy` when the queue is
        full), `finish` it later; what the caller does meanwhile counts against its deadline."""
        c: _Call[T] = _Call(fn, on_late)
        self._enqueue(c)
        return c

    def finish(self, c: _Call[T], timeout_s: float) -> T:
        """The result of a call `begin` started, waiting at most ``timeout_s`` more (then
        abandoned: `DiskTimeout`, and ``on_late`` gets its result when it returns)."""
        if not c.done.wait(max(0.0, timeout_s)):
            with self._cond:
                if not c.done.is_set():
                    c.abandoned = True
                    self.timeouts += 1
                    if c in self._queue:  # never started: it will not run at all
                        self._queue.remove(c)
            if c.abandoned:
                raise DiskTimeout(f"a disk call did not answer within {self.timeout_s:g} s")
        if c.error is not None:
            raise c.error
        return c.result  # type: ignore[no-any-return]

    def submit(self, fn: Callable[[], object]) -> bool:
        """Run ``fn()`` with nobody waiting (its exceptions are its own to handle); False when
        the pool is busy or stopping."""
        try:
            self._enqueue(_Call(fn, None, abandoned=True))
        except DiskBusy:
            return False
        return True

    def stalled_for(self) -> float:
        """Seconds the oldest running call has run (0: none runs)."""
        now = self._clock()
        with self._cond:
            return max((now - c.started for c in self._running), default=0.0)

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def _enqueue(self, c: _Call[Any]) -> None:
        with self._cond:
            if self._stopping:
                raise DiskBusy("the file tier is stopping")
            if len(self._queue) >= self.max_pending:
                self.refused += 1
                raise DiskBusy(f"{len(self._queue)} disk calls wait already (the disk is not keeping up)")
            self._queue.append(c)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._queue:
                    return
                c = self._queue.popleft()
                c.started = self._clock()
                self._running.add(c)
            try:
                c.result = c.fn()
            except BaseException as exc:  # the caller's to see (or nobody's, once abandoned)
                c.error = exc
            with self._cond:
                self._running.discard(c)
                late = c.abandoned
                c.done.set()
            if late and c.error is None and c.on_late is not None:
                with contextlib.suppress(Exception):  # a failed cleanup must not end the thread
                    c.on_late(c.result)
