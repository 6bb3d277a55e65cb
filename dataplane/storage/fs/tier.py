"""The file tier: chunks in files under ``fs_path`` (local NVMe, or a directory a fleet shares),
between L1 and the remote tier; they survive restarts (`layout` has the layout).

- **Index**: what this server knows is on disk (key -> scope and size), in least-recently-used
  order, and the bytes it adds up to. At start it is empty and the server serves at once; the
  writer thread rebuilds it from a scan (sweeping stale temporary files), and rescans every
  `RESCAN_S` to learn what other servers of a shared directory wrote or removed. A key not in
  the index is looked for on disk (one ``stat``), so a restart or another server's write is a
  hit before any scan has seen it.
- **Writes** are behind: `put` queues (bounded in bytes; more is dropped and counted, as for
  the remote tier) and the thread ``kvwarden-fs-writer`` (start/stop/join) writes each chunk
  whole under a temporary name and renames it in place, first evicting (LRU) until it fits
  under ``capacity_bytes``; the writer waits for the first scan, so the cap holds across
  restarts. A file another server removed is simply gone; one it replaced is the same chunk.
- **Reads** (`reads`: `get`, `get_into`, `held`) run on the I/O threads (`disk.DiskPool`)
  with a deadline (past it: a miss), but for the copy of a read in place, which never waits on
  the disk (`resident`). A file that fails its check is counted, removed and never served.
- **Out of space** (ENOSPC, EDQUOT: a full disk, or a shared one that other data filled) is not
  an outage (`lower.WriteSpace`): writes stop (dropped, counted ``no_space``, one warning), the
  files on disk are still served, and the tier stays healthy, degraded. Writes resume when the
  tier's own eviction removes files, or when a health round's probe file is written and the disk
  has room for the write that failed, or when a write let through as a try (at most one a
  second, when ``statvfs`` shows room for it) lands.
- **Clearing a scope** (`clear_scope`, on the caller's thread): its queued writes are dropped
  (counted ``cleared``), the write in progress is waited for, then its chunk files are removed
  and forgotten; none of this server's writes of that scope lands after it returns.
- **Health**: `ping` / `probe` round-trip a probe file; failed disk calls (never for want of
  space) trip the check as failed remote reads do; ``bypassed`` (local_cpu fallback) makes every
  call a miss or a drop.
"""

from __future__ import annotations

import collections
import errno
import fnmatch
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dataplane.events.sink import NO_EVENTS, EventSink
from dataplane.events.vllm_format import MEDIUM_DISK
from dataplane.storage import compress
from dataplane.storage.fs import chunk_file, resident
from dataplane.storage.fs.chunk_file import failure_kind
from dataplane.storage.fs.disk import DiskPool, DiskTimeout
from dataplane.storage.fs.index import FileIndex
from dataplane.storage.fs.layout import FORMAT_DIR, KEY_HEX, SUFFIX, ScanCounts, chunk_path, scan, scope_dir
from dataplane.storage.fs.reads import FileReads
from dataplane.storage.fs.stats import FsCounters, FsStats
from dataplane.storage.keys import ScopeMatch
from dataplane.storage.lower import OK, OTHER_ERROR, TIMEOUT, SpaceState, WriteSpace

logger = logging.getLogger(__name__)

RESCAN_S = 300.0  # how often the index is checked against the directory


@dataclass
class _FileWrite:
    scope: bytes
    key: bytes
    payload: memoryview
    done: Callable[[], None] | None
    trial: bool = False  # let through while out of space, to try whether the disk has room again
    words: str | None = None  # the dtype of the chunk's elements (which `compression` may code)


class FileTier(FileReads):
    name = "fs"

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        timeout_s: float = 1.0,
        queue_bytes: int = 256 << 20,
        io_threads: int = 4,
        health_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        eviction: str = "lru",
        compression: str = "none",
    ) -> None:
        if capacity_bytes <= 0 or queue_bytes <= 0 or timeout_s <= 0:
            raise ValueError("capacity_bytes, queue_bytes and timeout_s must be > 0")
        self.root = os.path.abspath(path)
        if not os.path.isdir(self.root):
            raise ValueError(f"fs_path {path!r}: not a directory (create it, or mount the volume there)")
        self.url = self.root  # (how checks and /status name it)
        self.capacity_bytes = capacity_bytes
        self.compression = compress.checked_setting(compression)  # coded on the writer thread
        self.queue_limit = queue_bytes
        self.health_timeout_s = health_timeout_s or timeout_s
        self.io = DiskPool(io_threads, timeout_s, clock=clock)
        self.index = FileIndex(eviction)  # (ValueError names an unknown policy)
        self.counters = FsCounters()
        self.space = WriteSpace(f"fs tier {self.root}", clock)  # writes stop while the disk is full
        self._clock = clock
        self._lock = threading.Lock()  # leaf: guards _queue, _queued_bytes, _writing_since, _rebuilt_at
        # held by the writer thread across all it does to the files and the index (taking a write
        # off the queue and writing it, evicting, rescanning) and by `clear_scope` across its
        # removals: a clear waits for the write in progress, and no write or scan of the writer
        # interleaves with it (so the index never names a file a clear removed). Taken before any
        # other lock (the index's, _lock, the counters'), never under one
        self._write_gate = threading.Lock()
        self._queue: collections.deque[_FileWrite] = collections.deque()
        self._queued_bytes = 0
        self._writing_since = 0.0  # when the write in progress started (0: none)
        self._rebuilt_at: float | None = None  # when the first scan ended
        self._started_at = clock()
        self.bypassed = False
        self.in_place = resident.supported()  # reads in place (`FileReads.get_into`) are tried
        self.events: EventSink = NO_EVENTS  # KV events: told of each file written and removed
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("FileTier already started")
        self.io.start()
        self._thread = threading.Thread(target=self._run, name="kvwarden-fs-writer", daemon=True)
        self._thread.start()
        if self.compression != "none":
            compress.WARMUP.start()  # (the writer codes with its kernels once compiled)

    def stop(self) -> None:
        """Stop the writer (what is still queued is dropped, counted ``stopped``) and the I/O threads."""
        self._stop.set()
        self._wake.set()
        self.io.stop()

    def join(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.io.join(timeout_s)
        compress.WARMUP.join(timeout_s)
        for w in self._take_all():
            self.counters.dropped("stopped")
            _done(w)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.io.is_alive()

    # ---------------------------------------------------------------- writes
    def put(
        self,
        scope: bytes,
        key: bytes,
        payload: memoryview,
        done: Callable[[], None] | None = None,
        words: str | None = None,
    ) -> bool:
        """Queue a write (never waits on the disk). ``payload`` must stay unchanged until
        ``done`` is called; ``words``: its elements' dtype (bfloat16 and float16 chunks are
        coded under ``compression``). False: dropped (queue full, bypassed, stopped, out of
        space), counted."""
        w = _FileWrite(scope, key, payload.cast("B"), done, words=words)
        reason = None
        admission = self.space.admit()  # (before the lock, which is a leaf)
        w.trial = admission == "try"
        with self._lock:
            if self.bypassed:
                reason = "bypassed"
            elif self._stop.is_set():
                reason = "stopped"
            elif admission == "drop":
                reason = "no_space"
            elif self._queued_bytes + w.payload.nbytes > self.queue_limit:
                reason = "full"
            else:
                self._queue.append(w)
                self._queued_bytes += w.payload.nbytes
        if reason is not None:
            self._dropped(reason)
            _done(w)
            return False
        self._wake.set()
        return True

    def _run(self) -> None:
        self._rescan()
        with self._lock:
            self._rebuilt_at = self._clock()
        next_scan = self._clock() + RESCAN_S
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_scan - self._clock()))
            self._wake.clear()
            while not self._stop.is_set() and self._write_next():
                pass
            if self._clock() >= next_scan and not self._stop.is_set():
                self._rescan()
                next_scan = self._clock() + RESCAN_S

    def _write_next(self) -> bool:
        """Take the next queued write and write it (the gate held from its take to its end: a
        clear purging the queue either finds it queued or waits for it); False: none queued."""
        w: _FileWrite | None = None
        try:
            with self._write_gate:
                with self._lock:
                    if not self._queue:
                        return False
                    w = self._queue.popleft()
                    self._queued_bytes -= w.payload.nbytes
                    self._writing_since = self._clock()
                try:
                    self._write(w)
                finally:
                    with self._lock:
                        self._writing_since = 0.0
        finally:
            if w is not None:
                _done(w)
        return True

    def _write(self, w: _FileWrite) -> None:
        if self.bypassed or w.key in self.index:  # (bypassed meanwhile; or on disk already)
            return
        coded = compress.encode(w.payload, w.words, self.compression)
        body: memoryview | bytes
        if coded is None:
            header, body = chunk_file.file_header(w.key, w.payload), w.payload
        else:
            header, body = chunk_file.file_header(w.key, coded[1], coded[0], w.payload.nbytes), coded[1]
        size = len(header) + len(body)
        if self.space.out and not (w.trial and self._room_for(size)):  # (queued before it filled)
            self._dropped("no_space")
            return
        if size > self.capacity_bytes:
            self.counters.dropped("full")
            return
        self._evict(size)
        path = chunk_path(self.root, w.scope, w.key)
        try:
            self._timed_here("put", lambda: chunk_file.write_chunk(path, self.root, (header, body)))
        except OSError as exc:
            self._failed("put", exc)
            if failure_kind(exc) == "no_space":
                self.space.ran_out(f"{_errname(exc)} writing a chunk file of {size} bytes", need=size)
                self._dropped("no_space")
            return
        self.space.freed("a chunk file fit again")  # (nothing, unless out of space: a try landed)
        self.counters.add(puts=1, bytes_written=size)
        if coded is not None:
            self.counters.add(coded_puts=1, coded_bytes_saved=w.payload.nbytes - len(body))
        self.index.learn(w.scope, w.key, size)
        self.events.stored(w.key, MEDIUM_DISK)

    def _room_for(self, size: int) -> bool:
        """Whether the disk shows room for ``size`` bytes (unknown: worth a try)."""
        free = chunk_file.free_bytes(self.root)
        return free is None or free >= size

    def _evict(self, room: int) -> None:
        """Remove files, in the index's order (`fs_eviction`), until ``room`` more bytes fit under
        the cap."""
        removed = 0
        for key, f in self.index.victims(room, self.capacity_bytes):
            try:
                gone = not chunk_file.remove(chunk_path(self.root, f.scope, key))
            except OSError as exc:
                self._failed("put", exc)
                continue
            self.counters.add(evictions=1, evicted_gone=int(gone))
            self.events.removed(key, MEDIUM_DISK)
            removed += int(not gone)
        if removed:
            self.space.freed(f"{removed} chunk files evicted")

    def _rescan(self) -> None:
        """Match the index to the directory (`FileIndex.merge`), then keep the cap."""
        counts = ScanCounts()
        with self._write_gate:  # (a clear meanwhile would leave files it removed in the index)
            found = list(scan(self.root, counts, self._stop.is_set))
            if self._stop.is_set():
                return
            self.index.merge(found)
            self.counters.add(swept=counts.swept, scan_errors=counts.errors)
            self._evict(0)
        with self._lock:
            first = self._rebuilt_at is None
        if first:
            n, used = self.index.sizes()
            what = (n, used, self.root, counts.swept)
            logger.info("fs tier: %d chunk files, %d bytes, under %s (%d stale temporary files swept)", *what)

    # ----------------------------------------------------------------- clear
    def clear_scope(self, scope: ScopeMatch) -> int | None:
        """Remove every chunk file whose filing scope ``scope`` matches under this tier's
        directory, and make sure none of this server's writes of them lands afterwards: those
        queued are dropped (``done`` called, counted ``cleared``), the one in progress is waited
        for. The files removed (one already gone, another server's doing, is not counted;
        temporary files, other servers' writes in progress, stay); None (one warning) when the
        tier is bypassed or a disk call fails. Runs on the caller's thread, as long as the disk
        takes: never the loop's."""
        if not scope.head:
            raise ValueError("clear_scope: an empty scope")
        if self.bypassed:
            logger.warning("fs tier: scope %s not cleared: the tier is bypassed", scope)
            return None
        with self._lock:
            kept = collections.deque(w for w in self._queue if not scope.matches(w.scope))
            dropped = [w for w in self._queue if scope.matches(w.scope)]
            self._queue = kept
            self._queued_bytes -= sum(w.payload.nbytes for w in dropped)
        for w in dropped:
            self._dropped("cleared")
            _done(w)
        removed = 0
        with self._write_gate:  # (waits for the write in progress, or the scan)
            try:
                for filed in self._filed_scopes(scope):
                    removed += self._remove_scope_files(filed)
                    self.index.forget_scope(filed)  # (known here, but gone from the disk already)
            except OSError as exc:
                where = exc.filename or os.path.join(self.root, FORMAT_DIR)
                logger.warning("fs tier: scope %s not cleared: %s on %s", scope, _errname(exc), where)
                return None
        return removed

    def _filed_scopes(self, scope: ScopeMatch) -> list[bytes]:
        """The filing scopes on disk that ``scope`` matches (their directories' names)."""
        if scope.exact:
            return [scope.head]
        pattern = scope.hex_glob()
        found = []
        for name in _subdirs(os.path.join(self.root, FORMAT_DIR)):
            if len(name) == len(pattern) and fnmatch.fnmatchcase(name, pattern):
                try:
                    found.append(bytes.fromhex(name))
                except ValueError:
                    continue  # (not a scope's directory)
        return found

    def _remove_scope_files(self, scope: bytes) -> int:
        """Remove ``scope``'s chunk files (the gate held), each forgotten and told removed: how
        many this call removed. A directory or file already gone is skipped; any other OSError
        is raised."""
        top = scope_dir(self.root, scope)
        removed = 0
        for a in _subdirs(top):
            for b in _subdirs(os.path.join(top, a)):
                leaf = os.path.join(top, a, b)
                for name, key in _chunk_files(leaf):
                    if chunk_file.remove(os.path.join(leaf, name)):
                        removed += 1
                        self.events.removed(key, MEDIUM_DISK)
                    self.index.forget(key)
        return removed

    # ---------------------------------------------------------------- health
    def probe(self) -> bool:
        """A probe file written, read back equal and removed within the health timeout."""
        return self.ping()[1] == OK

    def ping(self) -> tuple[float, int]:
        """(latency in seconds, code: 0 ok, -1 past the health timeout, -2 any other failure):
        a probe round trip, or -1 while a disk call has not returned for longer than the timeout.
        A disk too full for the probe file answers: 0, and writes stop (`space`); a probe file
        written while they are stopped, with room for the write that failed, resumes them."""
        t0 = time.perf_counter()
        if self.stalled_for() > self.health_timeout_s:
            code = TIMEOUT
        else:
            try:
                ok, free = self.io.call(self._probe, timeout_s=self.health_timeout_s)
                code = OK if ok else OTHER_ERROR
                if ok and self.space.out and (free is None or free >= self.space.need()):
                    room = "unknown" if free is None else f"{free}"
                    self.space.freed(f"the probe file was written, {room} bytes free")
            except DiskTimeout:
                code = TIMEOUT
            except OSError as exc:
                code = OTHER_ERROR
                if failure_kind(exc) == "no_space":
                    self.space.ran_out(f"{_errname(exc)} writing the probe file")
                    code = OK  # the disk answers: out of space, not an outage
        latency = time.perf_counter() - t0
        self.counters.pinged(latency, code)
        return latency, code

    def _probe(self) -> tuple[bool, int | None]:
        """A probe file's round trip and, when it made one, the bytes the disk has free."""
        ok = chunk_file.probe(self.root)
        return ok, chunk_file.free_bytes(self.root) if ok else None

    def space_state(self) -> SpaceState:
        return self.space.state()

    def stalled_for(self) -> float:
        """How long the oldest disk call in progress (a read or the writer's) has run."""
        with self._lock:
            since = self._writing_since
        writer = self._clock() - since if since else 0.0
        return max(writer, self.io.stalled_for())

    def withdraw_events(self) -> None:
        self.events.removed_all(MEDIUM_DISK)

    def take_failed_gets(self) -> int:
        """Failed disk calls since the last call (the health check's per-round count)."""
        return self.counters.take_failed()

    def flush(self, timeout_s: float) -> bool:
        """Wait (polling, up to ``timeout_s``) until the queue is written: tests and shutdown."""
        deadline = time.monotonic() + timeout_s
        pause = threading.Event()
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and not self._writing_since and self._rebuilt_at is not None:
                    return True
            pause.wait(0.005)
        return False

    def stats(self) -> FsStats:
        stalled = self.stalled_for()
        files, used = self.index.sizes()
        with self._lock:
            rebuilt, depth, qbytes = self._rebuilt_at, len(self._queue), self._queued_bytes
        return self.counters.snapshot(
            root=self.root,
            capacity_bytes=self.capacity_bytes,
            policy=self.index.policy,
            files=files,
            used_bytes=used,
            rebuilt=rebuilt is not None,
            rebuild_seconds=None if rebuilt is None else rebuilt - self._started_at,
            queue_depth=depth,
            queue_bytes=qbytes,
            stalled_seconds=stalled,
            space=self.space.state(),
        )

    def _dropped(self, reason: str) -> None:
        self.counters.dropped(reason)
        if reason == "no_space":
            self.space.dropped()

    def _take_all(self) -> list[_FileWrite]:
        with self._lock:
            out, self._queue, self._queued_bytes = list(self._queue), collections.deque(), 0
        return out


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, "OSError") + (f" ({exc.strerror})" if exc.strerror else "")


def _subdirs(path: str) -> list[str]:
    """The directories in ``path`` ([] when it is gone)."""
    try:
        with os.scandir(path) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _chunk_files(path: str) -> list[tuple[str, bytes]]:
    """(name, key) of each chunk file in ``path`` ([] when it is gone); temporary files (a
    writer's in progress: ``.<key>.kv.<...>.tmp``) and other names are left out."""
    try:
        with os.scandir(path) as it:
            entries = [e for e in it if not e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        if len(e.name) != KEY_HEX + len(SUFFIX) or not e.name.endswith(SUFFIX):
            continue
        try:
            out.append((e.name, bytes.fromhex(e.name[:KEY_HEX])))
        except ValueError:
            continue
    return out


def _done(w: _FileWrite) -> None:
    if w.done is not None:
        w.done()
