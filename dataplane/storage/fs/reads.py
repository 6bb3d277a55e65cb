"""The file tier's reads (`FileTier` is a `FileReads`): what a LOOKUP and a RETRIEVE ask of it.

- `held`: how far the files continue a prefix (the index, then a ``stat`` for what it lacks).
- `get`: a chunk read into a staging buffer (L1's), on the I/O threads under the deadline.
- `get_into`: a chunk read in place, from the page cache straight into the caller's views (the
  worker's blocks; `resident`), when the page cache holds the whole file; else the caller
  falls back to `get`. Its open and header check run on the I/O threads under the deadline;
  the copy itself never waits on the disk (idle I/O threads copy parts of it: `resident.Parts`).
- `get_many_into`: several chunks read in place side by side, each on an I/O thread
  (`resident.CopyGate` keeps a late one from copying once the request has answered).
- `get_through`: `get`, followed by the caller's thread as it lands, each piece checked and
  copied on into the caller's views (a cold chunk: it ends soon after the disk does).

A file that fails its check is counted, removed and never served.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from dataplane.events.sink import EventSink
from dataplane.events.vllm_format import MEDIUM_DISK
from dataplane.storage.compress import NONE
from dataplane.storage.fs import chunk_file, resident
from dataplane.storage.fs.chunk_file import BadFile, Opened, failure_kind
from dataplane.storage.fs.disk import DiskPool, DiskTimeout
from dataplane.storage.fs.index import FileIndex
from dataplane.storage.fs.layout import chunk_path
from dataplane.storage.fs.stats import FsCounters

logger = logging.getLogger(__name__)

_GRACE_S = 0.05  # a read whose bytes all landed is given this long to return, past its deadline
TOUCH_AFTER_S = 60.0  # a hit refreshes the file's time when it is older than this
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
T = TypeVar("T")


class FileReads:
    root: str
    bypassed: bool
    index: FileIndex
    counters: FsCounters
    events: EventSink
    io: DiskPool
    in_place: bool  # reads in place are tried (off once the file system refuses them)

    # ----------------------------------------------------------------- reads
    def held(self, scope: bytes, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are on disk: the index, then one ``stat`` each
        for those it does not know (on the I/O threads, within the deadline; 0 more on failure)."""
        if self.bypassed or not keys:
            return 0
        n = self.index.prefix(keys)
        if n == len(keys):
            return n
        rest = keys[n:]
        try:
            return n + self._timed("exists", lambda: self._stat_prefix(scope, rest))
        except (OSError, DiskTimeout) as exc:
            self._failed("get", exc)
            return n

    def _stat_prefix(self, scope: bytes, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            size = chunk_file.exists(chunk_path(self.root, scope, k))
            if size is None:
                break
            self.index.learn(scope, k, size)
            n += 1
        return n

    def get(
        self,
        scope: bytes,
        key: bytes,
        nbytes: int | None,
        alloc: Callable[[int], memoryview | None],
        give_back: Callable[[memoryview], None],
        wait: bool = True,
        hit: bool = True,
    ) -> memoryview | None:
        """The chunk of ``key`` read into ``alloc(size)``'s buffer, checked; None: not there,
        damaged, no room, failed or past the deadline (counted). A buffer the caller will not
        get goes to ``give_back``. ``wait=False``: read on this thread (an I/O thread).
        ``hit=False``: a read found is not counted (a chunk read in place, brought into L1)."""
        if self.bypassed:
            return None
        path = chunk_path(self.root, scope, key)

        def read() -> tuple[memoryview | None, int]:
            got: list[memoryview] = []

            def take(n: int) -> memoryview | None:
                buf = alloc(n)
                if buf is not None:
                    got.append(buf)
                return buf

            try:
                r = chunk_file.read_chunk(path, key, nbytes, take)
            except BaseException:
                for b in got:
                    give_back(b)
                raise
            if r is None:
                return None, 0
            buf, mtime, size = r
            if time.time() - mtime > TOUCH_AFTER_S:
                chunk_file.touch(path)
            return buf, size

        def late(r: tuple[memoryview | None, int]) -> None:
            if r[0] is not None:
                give_back(r[0])

        try:
            buf, size = self._timed("get", read, on_late=late) if wait else self._timed_here("get", read)
        except BadFile as exc:
            self._bad(path, key, exc)
            return None
        except (OSError, DiskTimeout) as exc:
            self._failed("get", exc)
            return None
        if buf is None:
            self._gone(key)
            return None
        if hit:
            self.counters.read(buf.nbytes)
        self.index.learn(scope, key, size, read=hit)  # (a promotion: its read was counted)
        return buf

    def get_into(
        self,
        scope: bytes,
        key: bytes,
        nbytes: int | None,
        views_for: Callable[[int], Sequence[memoryview] | None],
    ) -> bool | None:
        """The chunk of ``key`` read in place into ``views_for(size)`` and checked: True. False:
        not read in place (not all in the page cache, no views, not supported): the caller reads
        it with `get`. None: a miss (not there, damaged, failed, past the deadline; counted)."""
        if self.bypassed:
            return None
        if not self.in_place:
            return False
        path = chunk_path(self.root, scope, key)

        def read() -> Opened | bool | None:
            f = self._timed("get", lambda: chunk_file.open_chunk(path, key, nbytes), on_late=_close)
            if f is None:
                return None
            try:
                if f.header.codec != NONE:  # a coded file is decoded, not read in place: `get`
                    return False
                views = views_for(f.header.nbytes)
                if views is None:
                    return False
                ways = min(self.io.threads + 1, _CORES)
                return f if resident.read_resident(f, views, ways, self.io.submit) else False
            finally:
                os.close(f.fd)

        return self._settle(scope, key, path, read)

    def get_many_into(
        self,
        scope: bytes,
        keys: Sequence[bytes],
        nbytes: int,
        views_for: Callable[[int], Sequence[memoryview] | None],
    ) -> list[bool | None]:
        """`get_into` for several chunks at once: each opened, checked, copied into
        ``views_for(i)`` and checked on an I/O thread, all started together, within one
        deadline. `get_into`'s answers (True, False, None), in order, up to the first that is
        not True; [] when fewer than two chunks have views (the caller goes one by one)."""
        views: list[Sequence[memoryview]] = []
        for v in map(views_for, range(len(keys))):
            if v is None:
                break
            views.append(v)
        if len(views) < 2 or self.bypassed or not self.in_place:
            return []
        gate = resident.CopyGate()
        deadline = time.monotonic() + self.io.timeout_s
        paths = [chunk_path(self.root, scope, k) for k in keys[: len(views)]]
        calls = []
        for path, key, v in zip(paths, keys, views, strict=False):
            try:
                calls.append(self.io.begin(functools.partial(_in_place, path, key, nbytes, v, gate)))
            except DiskTimeout:  # (DiskBusy: the queue is full) the rest one by one
                break
        out: list[bool | None] = []
        t0 = time.perf_counter()
        try:
            for path, key, c in zip(paths, keys, calls, strict=False):
                finish = functools.partial(self.io.finish, c, deadline - time.monotonic())
                r = self._settle(scope, key, path, finish)
                self.counters.took("get", time.perf_counter() - t0)
                out.append(r)
                if r is not True:
                    break
        finally:
            gate.shut()  # nothing lands in the views once this returns
        return out

    def get_through(
        self,
        scope: bytes,
        key: bytes,
        nbytes: int | None,
        alloc: Callable[[int], memoryview | None],
        give_back: Callable[[memoryview], None],
        views_for: Callable[[int], Sequence[memoryview] | None],
    ) -> tuple[memoryview, bool] | None:
        """`get`, with the chunk copied on into ``views_for(size)`` (the worker's blocks) by this
        thread piece by piece as the I/O thread's read lands (and hashes) them, so the copy ends
        soon after the disk does; the read's check decides whether they count. (The buffer,
        whether the views got it too: False when ``views_for`` gave none); None: a miss
        (counted). The views are written from the buffer only, by this thread: a read past the
        deadline lands nowhere but the buffer."""
        if self.bypassed:
            return None
        path = chunk_path(self.root, scope, key)
        landing = resident.Landing()
        read, late = _landing_read(path, key, nbytes, alloc, give_back, landing)
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.io.timeout_s
        bad: BadFile | None = None
        try:
            call = self.io.begin(read, on_late=late)
            views = None
            if landing.wait(0, deadline) >= 0 and landing.opened is not None:
                views = views_for(landing.opened.header.nbytes)
            try:
                whole = resident.follow(landing, views, deadline)
            except BadFile as exc:
                whole, bad = False, exc
            if not whole:
                landing.abandon()
            r = self.io.finish(call, max(deadline - time.monotonic(), _GRACE_S if whole else 0.0))
        except BadFile as exc:  # (the read's own: a damaged header, a file cut short)
            self._bad(path, key, exc)
            return None
        except (OSError, DiskTimeout) as exc:
            landing.abandon()
            self._failed("get", exc)
            return None
        finally:
            self.counters.took("get", time.perf_counter() - t0)
        if r is None or bad is not None or not whole:
            if r is not None:
                give_back(r[0])
            if bad is not None:
                self._bad(path, key, bad)
            elif r is None:  # not there (or L1 has no room)
                self._gone(key)
            else:
                self._failed("get", DiskTimeout("a read did not land within its deadline"))
            return None
        self._hit(scope, key, path, r[0].nbytes, r[2], r[1])
        return r[0], views is not None

    def _settle(
        self, scope: bytes, key: bytes, path: str, read: Callable[[], Opened | bool | None]
    ) -> bool | None:
        """A read in place (``read``: its checked file, False: not read in place, None: no file)
        as `get_into` answers it, counted: True, False (read it another way) or None (a miss)."""
        try:
            r = read()
        except resident.InPlaceRefused:
            self.in_place = False
            return False
        except ValueError as exc:  # (views that do not fit the file: read it the staged way)
            logger.warning("fs tier: a read in place refused: %s", exc)
            return False
        except BadFile as exc:
            self._bad(path, key, exc)
            return None
        except (OSError, DiskTimeout) as exc:
            self._failed("get", exc)
            return None
        if r is None:
            self._gone(key)
            return None
        if r is False:
            return False
        assert isinstance(r, Opened)
        self._hit(scope, key, path, r.header.nbytes, r.size, r.mtime)
        self.counters.add(read_in_place=1)
        return True

    def _hit(self, scope: bytes, key: bytes, path: str, nbytes: int, size: int, mtime: float) -> None:
        """A chunk read whole and checked: counted, known, its file's time refreshed if old."""
        self.counters.read(nbytes)
        self.index.learn(scope, key, size, read=True)
        if time.time() - mtime > TOUCH_AFTER_S:
            self.io.submit(functools.partial(chunk_file.touch, path))

    def _gone(self, key: bytes) -> None:
        """A read found no file (gone, or never there): a miss, and the index forgets it."""
        self.counters.read(None)
        self.index.forget(key)

    def _bad(self, path: str, key: bytes, exc: BadFile) -> None:
        """A file that failed its check: counted, forgotten, removed (if still the same file)."""
        self.counters.read(None, exc.kind)
        self.index.forget(key)
        self.events.removed(key, MEDIUM_DISK)
        self.io.submit(functools.partial(chunk_file.remove_if, path, exc.ino))

    # --------------------------------------------------------------- helpers
    def _timed(self, op: str, fn: Callable[[], T], on_late: Callable[[T], None] | None = None) -> T:
        t0 = time.perf_counter()
        try:
            return self.io.call(fn, on_late=on_late)
        finally:
            self.counters.took(op, time.perf_counter() - t0)

    def _timed_here(self, op: str, fn: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.counters.took(op, time.perf_counter() - t0)

    def _failed(self, op: str, exc: BaseException) -> None:
        self.counters.failed(op, "timeout" if isinstance(exc, DiskTimeout) else failure_kind(exc))


def _in_place(
    path: str, key: bytes, nbytes: int, views: Sequence[memoryview], gate: resident.CopyGate
) -> Opened | bool | None:
    """An I/O thread's part of `FileReads.get_many_into`: the file read in place and checked
    (its `Opened`, closed), False (not all in memory, or the request stopped waiting: no copy),
    None (no file)."""
    f = chunk_file.open_chunk(path, key, nbytes)
    if f is None:
        return None
    try:
        if f.header.codec != NONE or not gate.enter():  # (a coded file decodes: not in place)
            return False
        try:
            return f if resident.read_resident(f, views) else False
        finally:
            gate.leave()
    finally:
        os.close(f.fd)


def _close(f: Opened | None) -> None:
    """A file opened for a read abandoned past its deadline: closed when the open returns."""
    if f is not None:
        os.close(f.fd)


def _landing_read(
    path: str,
    key: bytes,
    nbytes: int | None,
    alloc: Callable[[int], memoryview | None],
    give_back: Callable[[memoryview], None],
    landing: resident.Landing,
) -> tuple[
    Callable[[], tuple[memoryview, float, int] | None],
    Callable[[tuple[memoryview, float, int] | None], None],
]:
    """The I/O thread's part of `FileReads.get_through`: the read (its buffer given back when
    it fails) and what cleans up after it when nobody waits for it any more."""
    got: list[memoryview] = []

    def take(n: int) -> memoryview | None:
        buf = alloc(n)
        if buf is not None:
            got.append(buf)
        return buf

    def read() -> tuple[memoryview, float, int] | None:
        try:
            return chunk_file.read_chunk(path, key, nbytes, take, landing)
        except BaseException:
            for b in got:
                give_back(b)
            raise
        finally:
            landing.end()

    def late(r: tuple[memoryview, float, int] | None) -> None:
        if r is not None:
            give_back(r[0])

    return read, late
