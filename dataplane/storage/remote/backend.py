"""The remote tier: chunks in a Redis (or Valkey) that many kvwarden servers share.

A chunk is stored under ``<prefix><key hex>``, or ``<prefix><scope hex>:<key hex>`` in a scope
(the ``scope`` of `put`, `get`, `get_later`, `count_prefix`), in the format of `codec` (a header
that binds key, layout and a hash of the whole value, then the bytes). Chunk keys already bind
the model, world size, rank and layout (`dataplane.storage.keys`), so servers on different hosts
serving the same model find each other's chunks.

- **Reads** (`get`, `count_prefix`) run on the caller's thread, each bounded by
  ``timeout_s`` (the socket timeout of every send and receive; no retries). A value that fails a
  check of `codec` is a miss, counted by kind, and never returned. On `redis://` and `unix://`
  URLs they go through `direct.DirectGets`, which receives the payload straight into the
  buffer it lands in (an L1 buffer: ``get``'s ``alloc``); elsewhere through redis-py.
  `get_later` queues a read (a LOOKUP's read-ahead) for the thread ``kvwarden-remote-reader``,
  which answers a callback.
- **Writes** go through a write-behind queue bounded in bytes, drained by the thread
  ``kvwarden-remote-writer`` (start/stop/join). `put` never waits on Redis: when the queue is
  full or the backend is bypassed, the write is dropped and counted. Each write is one
  MULTI/EXEC of SET header + APPEND payload: atomic, one round trip, and the payload is sent from
  the caller's buffer without being copied into one value first.
- **Clearing a scope** (`clear_scope`) drops this server's queued writes of it, waits for the
  write on the wire, then SCANs for the scope's names and UNLINKs them (each removal reported
  to ``events``): none of this server's writes of the scope made before it lands after it.
- **Failures** are counted by kind (timeout, connection, auth, no_space, error; never a plain
  miss); ``failed_gets`` since the health monitor last took them is what trips its threshold.
- **Out of space** (Redis answering OOM: ``maxmemory`` with ``noeviction``) is not an outage
  (`lower.WriteSpace`): writes stop (dropped, counted ``no_space``, one warning), reads go on,
  and the backend stays healthy, degraded. A health round whose PING finds room again for the
  write that failed (``maxmemory`` raised, keys deleted) and whose probe key is written resumes
  them, and so does a write let through as a try (at most one a second, when ``INFO memory``
  shows room for it) that lands.
- The password never leaves this object: the URL is kept without it (`redact`), and errors are
  reported by kind and exception type, not by the client's message.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

import redis

from dataplane.events.sink import NO_EVENTS, EventSink
from dataplane.events.vllm_format import MEDIUM_EXTERNAL
from dataplane.storage import compress
from dataplane.storage.codec import RemoteValueError, check_header, check_layout, decode, encode_header
from dataplane.storage.keys import ScopeMatch
from dataplane.storage.lower import DURATION_BUCKETS, OK, SpaceState, WriteSpace
from dataplane.storage.remote.clear import unlink_scope
from dataplane.storage.remote.direct import NO_ROOM, DirectGets
from dataplane.storage.remote.health import RemoteAuthError as RemoteAuthError
from dataplane.storage.remote.health import ping_code, probe
from dataplane.storage.remote.read_ahead import Alloc, GiveBack, LaterRead, ReadAhead, Then
from dataplane.storage.remote.redis_client import Lazy, failure_kind, make_client, redact, room
from dataplane.storage.remote.stats import RemoteStats
from dataplane.storage.remote.writes import RedisWrite

logger = logging.getLogger(__name__)


class RemoteBackend:
    name = "redis"

    def __init__(
        self,
        url: str,
        password: str | None = None,
        timeout_s: float = 1.0,
        prefix: str = "kvwarden:",
        queue_bytes: int = 256 << 20,
        health_timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        compression: str = "none",
    ) -> None:
        # "lossless": the writer codes 16-bit chunks when it pays; readers decode either way
        self.compression = compress.checked_setting(compression)
        if timeout_s <= 0 or queue_bytes <= 0 or (health_timeout_s is not None and health_timeout_s <= 0):
            raise ValueError(
                f"timeout_s, queue_bytes and health_timeout_s must be > 0, got {timeout_s}, "
                f"{queue_bytes}, {health_timeout_s}"
            )
        self.url = redact(url)
        self.timeout_s = timeout_s
        self.prefix = prefix
        self.queue_limit = queue_bytes
        self._client = Lazy(lambda: make_client(url, password, timeout_s))
        self._direct = DirectGets.for_url(url, password, timeout_s)  # reads straight into L1
        # PING and the probe go through a client of their own: bounded by the health timeout,
        # and never queued behind the data path's connections
        self._health = Lazy(lambda: make_client(url, password, health_timeout_s or timeout_s))
        self.on_burst: Callable[[], None] | None = None  # called when failed reads reach burst_at
        self.burst_at = 0
        self._lock = threading.Lock()  # leaf: guards _stats, _queue, _queued_bytes, _inflight, _failed_gets
        # held by the writer from taking a write off the queue to its end, so that clear_scope,
        # taking it once it has purged the queue, waits out the write on the wire. Guards no
        # data; taken before _lock (never while holding _lock or any other lock)
        self._write_gate = threading.Lock()
        self._stats = RemoteStats()
        self._queue: collections.deque[RedisWrite] = collections.deque()
        self._queued_bytes = 0
        self._inflight = 0  # writes popped and not yet done
        self._failed_gets = 0
        self.bypassed = False
        self.space = WriteSpace(f"remote tier {self.url}", clock)  # writes stop while Redis answers OOM
        self.events: EventSink = NO_EVENTS  # KV events: told of each chunk written
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ahead = ReadAhead(self.get)

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("RemoteBackend already started")
        self._thread = threading.Thread(target=self._drain, name="kvwarden-remote-writer", daemon=True)
        self._thread.start()
        self._ahead.start()
        if self.compression != "none":
            compress.WARMUP.start()  # (the writer codes with its kernels once compiled)

    def stop(self) -> None:
        """Stop the writer and the reader: queued writes are dropped (counted), reads answered None."""
        self._stop.set()
        self._wake.set()
        self._ahead.stop()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
        self._ahead.join(timeout)
        compress.WARMUP.join(timeout)
        for w in self._take_all():
            self._count_drop("stopped")
            w.release()

    def close(self) -> None:
        self._client.close()
        if self._direct is not None:
            self._direct.close()
        self._health.close()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ----------------------------------------------------------------- reads
    def redis_key(self, key: bytes, scope: bytes = b"") -> str:
        """``<prefix><key hex>``; in a scope, ``<prefix><scope hex>:<key hex>``."""
        return self.prefix + (scope.hex() + ":" if scope else "") + key.hex()

    def get(
        self,
        key: bytes,
        dtype: str,
        shape: Sequence[int] | None,
        alloc: Alloc | None = None,
        give_back: GiveBack | None = None,
        scope: bytes = b"",
    ) -> memoryview | None:
        """The payload stored under ``key`` in ``scope`` (checked: right key, layout and hash),
        or None: a miss, a bad value (counted by kind) or a failure (counted; bounded by
        timeout_s). ``alloc``: where the payload goes, asked once its size is known (None: no
        room, the read is a miss); the view returned is then the one it gave, and a buffer it
        gave for a value that failed a check goes to ``give_back``."""
        if self.bypassed:
            return None
        t0 = time.perf_counter()
        try:
            if self._direct is not None:
                return self._get_direct(key, dtype, shape, alloc, give_back, scope)
            value = self._client().get(self.redis_key(key, scope))
        except redis.RedisError as exc:
            self._count_get_failure(failure_kind(exc))
            return None
        finally:
            self._took("get", time.perf_counter() - t0)
        with self._lock:
            self._stats.gets += 1
            if value is None:
                self._stats.misses += 1
                return None
        dst = None  # (a coded value decodes straight into alloc's buffer: no second copy)
        try:
            head = check_header(key, value, len(value), dtype, shape)  # type: ignore[arg-type]  # (bytes)
            dst = None if alloc is None else alloc(head.raw_nbytes)
            if alloc is not None and dst is None:
                return None  # (a hit of Redis's, with no room here)
            coded = head.codec != compress.NONE
            _, _, payload = decode(key, value, dtype, shape, dst if coded else None)  # type: ignore[arg-type]
        except RemoteValueError as exc:
            if dst is not None and give_back is not None:
                give_back(dst)
            self._count_bad(exc)
            return None
        if dst is not None and not coded:
            dst[:] = payload
        payload = payload if dst is None else dst
        self._count_hit(payload.nbytes)
        return payload

    def _get_direct(
        self,
        key: bytes,
        dtype: str,
        shape: Sequence[int] | None,
        alloc: Alloc | None,
        give_back: GiveBack | None,
        scope: bytes,
    ) -> memoryview | None:
        """`get` through the direct reader (`DirectGets.read`)."""
        assert self._direct is not None
        try:
            got = self._direct.read(key, self.redis_key(key, scope), dtype, shape, alloc, give_back)
        except RemoteValueError as exc:
            self._count_bad(exc, read=True)
            return None
        with self._lock:
            self._stats.gets += 1
            if got is None or got is NO_ROOM:
                self._stats.misses += int(got is None)
                return None
        self._count_hit(got.nbytes)
        return got

    def _count_bad(self, exc: RemoteValueError, read: bool = False) -> None:
        with self._lock:
            self._stats.gets += int(read)
            self._stats.misses += 1
            self._stats.bad_values[exc.kind] = self._stats.bad_values.get(exc.kind, 0) + 1

    def _count_hit(self, nbytes: int) -> None:
        with self._lock:
            self._stats.hits += 1
            self._stats.bytes_read += nbytes

    def get_later(
        self,
        key: bytes,
        dtype: str,
        shape: Sequence[int] | None,
        then: Then,
        alloc: Alloc | None = None,
        give_back: GiveBack | None = None,
        scope: bytes = b"",
    ) -> bool:
        """Queue `get` of ``key`` in ``scope`` (into ``alloc``'s buffer, as `get`) for the
        reader thread (`read_ahead`), which calls ``then`` with its answer. False (``then``
        never called): stopped, bypassed, or `READ_AHEAD_MAX` reads waiting."""
        if self.bypassed or self._stop.is_set():
            return False
        return self._ahead.add(
            LaterRead(key, dtype, None if shape is None else tuple(shape), then, alloc, give_back, scope)
        )

    def count_prefix(self, keys: Sequence[bytes], scope: bytes = b"") -> int:
        """How many of ``keys`` (in ``scope``), from the first, are held (one pipelined round
        trip; 0 on a failure, counted)."""
        if self.bypassed or not keys:
            return 0
        t0 = time.perf_counter()
        try:
            pipe = self._client().pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.redis_key(k, scope))
            found = pipe.execute()
        except redis.RedisError as exc:
            self._count_get_failure(failure_kind(exc))
            return 0
        finally:
            self._took("exists", time.perf_counter() - t0)
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        return n

    def ping(self) -> tuple[float, int]:
        """(latency in seconds, error code: 0 ok, -1 timeout, -2 any other error). While writes
        are stopped for want of space, a PING answered also asks whether there is room again."""
        t0 = time.perf_counter()
        code = ping_code(self._health, self.url, self.prefix, self.space)
        latency = time.perf_counter() - t0
        with self._lock:
            self._stats.ping_latency_s, self._stats.ping_code = latency, code
            if code == OK:
                self._stats.ping_successes += 1
            else:
                self._stats.ping_errors += 1
        return latency, code

    def probe(self) -> bool:
        """Put random bytes under a probe key, read them back: True when they round-trip equal
        (bounded by the health timeout; the key expires after a minute). A Redis that answers
        OOM answers: True, and writes stop (`space`)."""
        return probe(self._health, self.url, self.prefix, self.space)

    def _room_for(self, nbytes: int) -> bool:
        """Whether Redis shows room below ``maxmemory`` for ``nbytes`` (unknown: worth a try)."""
        left = room(self._client())
        return left is None or left >= nbytes

    def space_state(self) -> SpaceState:
        return self.space.state()

    def withdraw_events(self) -> None:
        self.events.removed_all(MEDIUM_EXTERNAL)

    def take_failed_gets(self) -> int:
        """Failed blocking reads since the last call (the health monitor's per-round count)."""
        with self._lock:
            n, self._failed_gets = self._failed_gets, 0
            return n

    # ---------------------------------------------------------------- writes
    def put(
        self,
        key: bytes,
        dtype: str,
        shape: Sequence[int],
        payload: memoryview,
        done: Callable[[], None] | None = None,
        scope: bytes = b"",
        words: str | None = None,
    ) -> bool:
        """Queue a write of ``key`` in ``scope`` (never waits on Redis). ``payload`` must stay
        unchanged until ``done`` is called (by the writer once sent or failed, or here when the
        write is dropped). False: dropped (queue full, bypassed, stopped), counted. ``words``:
        the dtype of the chunk's elements, which the writer may code (``compression``)."""
        if not payload.contiguous:
            raise ValueError("payload must be a contiguous buffer")
        check_layout(dtype, shape, payload.nbytes)
        # the header (a hash of the whole payload, ~2 ms for 32 MiB) is made by the writer
        w = RedisWrite(key, dtype, tuple(shape), payload, done, scope=scope, words=words)
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
            elif self._queued_bytes + payload.nbytes > self.queue_limit:
                reason = "full"
            else:
                self._queue.append(w)
                self._queued_bytes += payload.nbytes
        if reason is not None:
            self._count_drop(reason)
            w.release()
            return False
        self._wake.set()
        return True

    def _drain(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            while not self._stop.is_set() and self._write_next():
                pass

    def _write_next(self) -> bool:
        """Send the first queued write (False: none), under the write gate; ``done`` after it."""
        w = None
        try:
            with self._write_gate:
                with self._lock:
                    if not self._queue:
                        return False
                    w = self._queue.popleft()
                    self._queued_bytes -= w.payload.nbytes
                    self._inflight += 1
                self._write(w)
        finally:
            if w is not None:
                w.release()
                with self._lock:
                    self._inflight -= 1
        return True

    def _write(self, w: RedisWrite) -> None:
        if self.space.out and not (w.trial and self._room_for(w.payload.nbytes)):  # (queued before)
            self._count_drop("no_space")
            return
        t0 = time.perf_counter()
        try:
            pipe = self._client().pipeline(transaction=True)
            coded = compress.encode(w.payload, w.words, self.compression)  # (this thread: the writer)
            codec, body = coded if coded is not None else (compress.NONE, w.payload)
            header = encode_header(w.key, w.dtype, w.shape, body, codec)
            name = self.redis_key(w.key, w.scope)
            pipe.set(name, header)
            pipe.append(name, body)
            pipe.execute()
        except Exception as exc:  # counted: the writer never dies of one write
            kind = failure_kind(exc)
            with self._lock:
                self._stats.put_failures[kind] += 1
            if kind == "no_space":
                self.space.ran_out(f"OOM writing a chunk of {w.payload.nbytes} bytes", need=w.payload.nbytes)
                self._count_drop("no_space")
            return
        finally:
            self._took("put", time.perf_counter() - t0)
        self.space.freed("a chunk fit again")  # (nothing, unless out of space: a try landed)
        with self._lock:
            self._stats.count_put(len(header) + len(body), w.payload.nbytes - len(body) if codec else None)
        self.events.stored(w.key, MEDIUM_EXTERNAL)

    # ----------------------------------------------------------------- clear
    def clear_scope(self, scope: ScopeMatch) -> int | None:
        """Remove every chunk this Redis holds whose filing scope ``scope`` matches
        (`dataplane.storage.keys`): how many UNLINK removed (each one
        reported to ``events``). None when that is not known to be all of them: a Redis failure
        (one warning naming its kind), or the tier bypassed (known down).

        First this server's queued writes of ``scope`` are dropped (counted ``cleared``) and the
        write on the wire is waited for, so none put before the call lands after it (a put of
        ``scope`` made while it runs may land or not)."""
        if not scope.head:
            raise ValueError("clear_scope needs a scope (the unscoped chunks are no scope's)")
        self._purge(scope)
        with self._write_gate:  # the write on the wire (it may be of this scope) has ended
            pass
        if self.bypassed:
            logger.warning("remote tier %s: scope %s not cleared: bypassed", self.url, scope)
            return None
        removed = 0
        try:
            for n, keys in unlink_scope(self._client(), self.prefix, scope):
                removed += n
                with self._lock:
                    self._stats.cleared += n
                for key in keys:
                    self.events.removed(key, MEDIUM_EXTERNAL)
        except redis.RedisError as exc:
            why = failure_kind(exc)
            logger.warning("remote tier %s: clearing scope %s failed (%s)", self.url, scope, why)
            return None
        return removed

    def _purge(self, scope: ScopeMatch) -> None:
        """Drop the queued writes ``scope`` matches (the others stay queued, in order)."""
        with self._lock:
            gone = [w for w in self._queue if scope.matches(w.scope)]
            self._queue = collections.deque(w for w in self._queue if not scope.matches(w.scope))
            self._queued_bytes -= sum(w.payload.nbytes for w in gone)
        for w in gone:
            self._count_drop("cleared")
            w.release()

    def flush(self, timeout_s: float) -> bool:
        """Wait (polling, up to ``timeout_s``) until the queue is empty: tests and shutdown."""
        deadline = time.monotonic() + timeout_s
        pause = threading.Event()
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and not self._inflight:
                    return True
            pause.wait(0.005)
        return False

    # ---------------------------------------------------------------- helpers
    def stats(self) -> RemoteStats:
        with self._lock:
            return self._stats.copy(len(self._queue), self._queued_bytes, self.space.state())

    def _take_all(self) -> list[RedisWrite]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            return out

    def _took(self, op: str, seconds: float) -> None:
        i = bisect.bisect_left(DURATION_BUCKETS, seconds)
        with self._lock:
            self._stats.durations[op][i] += 1
            self._stats.duration_sums[op] += seconds

    def _count_get_failure(self, kind: str) -> None:
        with self._lock:
            self._stats.get_failures[kind] += 1
            self._failed_gets += 1
            burst = self._failed_gets == self.burst_at
        if burst and self.on_burst is not None:
            self.on_burst()  # the health monitor: a round now, not at the end of its interval

    def _count_drop(self, reason: str) -> None:
        with self._lock:
            self._stats.drops[reason] += 1
        if reason == "no_space":
            self.space.dropped()
