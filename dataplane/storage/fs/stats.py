"""What the file tier reports (`FileTier.stats`): a snapshot, for `/status` and `/metrics`."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dataplane.storage.fs.chunk_file import FAILURE_KINDS
from dataplane.storage.lower import DROP_REASONS, DURATION_BUCKETS, OPS, SpaceState

__all__ = ["DURATION_BUCKETS", "OPS", "FsCounters", "FsStats"]


@dataclass(frozen=True, slots=True)
class FsStats:
    root: str
    capacity_bytes: int
    policy: str  # the eviction order (fs_eviction): lru or lfuda
    files: int  # chunk files this server knows of (its index)
    used_bytes: int  # their bytes, headers included
    rebuilt: bool  # the first scan after start has ended
    rebuild_seconds: float | None  # how long it took
    swept: int  # stale temporary files removed
    scan_errors: int
    gets: int
    hits: int
    misses: int  # not there, and damaged files (also in bad_files)
    bytes_read: int
    puts: int
    bytes_written: int
    coded_puts: int  # chunk files written coded (fs_compression lossless)
    coded_bytes_saved: int  # the bytes their coding saved
    evictions: int
    evicted_gone: int  # evictions of files another server had removed already
    read_ahead: int  # chunks read into L1 ahead of a RETRIEVE, because a LOOKUP found them
    read_in_place: int  # chunks read from the page cache straight into a worker's blocks
    promoted: int  # chunks read in place, then brought into L1 behind the RETRIEVE
    get_failures: dict[str, int]  # by kind (chunk_file.FAILURE_KINDS)
    put_failures: dict[str, int]
    bad_files: dict[str, int]  # by kind (codec.VALUE_ERROR_KINDS)
    drops: dict[str, int]  # writes dropped, by reason (lower.DROP_REASONS, and cleared)
    queue_depth: int
    queue_bytes: int
    stalled_seconds: float  # how long the oldest disk call in progress has run
    ping_latency_s: float
    ping_code: int
    durations: dict[str, list[int]]  # op -> counts per bucket of DURATION_BUCKETS (+Inf last)
    duration_sums: dict[str, float]
    space: SpaceState  # writes stopped while the disk is full (`lower.WriteSpace`)
    duration_buckets: tuple[float, ...] = DURATION_BUCKETS  # the upper bounds (+Inf after them)


class FsCounters:
    """The file tier's counters (their own lock, a leaf), and the failed disk calls since the
    health check last took them; ``on_burst`` is called when those reach ``burst_at``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # leaf: guards every field below
        self.gets = self.hits = self.misses = self.bytes_read = 0
        self.puts = self.bytes_written = self.evictions = self.evicted_gone = self.read_ahead = 0
        self.read_in_place = self.promoted = 0
        self.coded_puts = self.coded_bytes_saved = 0
        self.swept = self.scan_errors = 0
        self.get_failures = dict.fromkeys(FAILURE_KINDS, 0)
        self.put_failures = dict.fromkeys(FAILURE_KINDS, 0)
        self.bad_files: dict[str, int] = {}
        self.drops = dict.fromkeys((*DROP_REASONS, "cleared"), 0)
        self.durations = {op: [0] * (len(DURATION_BUCKETS) + 1) for op in OPS}
        self.duration_sums = dict.fromkeys(OPS, 0.0)
        self.ping_latency_s = 0.0
        self.ping_code = 0
        self._failed = 0
        self.on_burst: Callable[[], None] | None = None
        self.burst_at = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def read(self, found: int | None, bad: str | None = None) -> None:
        """A read ended: ``found`` bytes (None: a miss; ``bad``: a damaged file's kind)."""
        with self._lock:
            self.gets += 1
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
                self.bytes_read += found
            if bad is not None:
                self.bad_files[bad] = self.bad_files.get(bad, 0) + 1

    def dropped(self, reason: str) -> None:
        """A write dropped: ``reason`` one of `DROP_REASONS`, or ``cleared`` (its scope
        cleared, `FileTier.clear_scope`)."""
        with self._lock:
            self.drops[reason] += 1

    def failed(self, op: str, kind: str) -> None:
        """A failed disk call (``op``: get or put) of ``kind``; all but ``no_space`` count toward
        the health check (a full disk answers: it is not an outage)."""
        with self._lock:
            (self.get_failures if op == "get" else self.put_failures)[kind] += 1
            if kind == "no_space":
                return
            self._failed += 1
            burst = self._failed == self.burst_at
        if burst and self.on_burst is not None:
            self.on_burst()  # the health monitor: a round now, not at the end of its interval

    def take_failed(self) -> int:
        with self._lock:
            n, self._failed = self._failed, 0
            return n

    def took(self, op: str, seconds: float) -> None:
        i = bisect.bisect_left(DURATION_BUCKETS, seconds)
        with self._lock:
            self.durations[op][i] += 1
            self.duration_sums[op] += seconds

    def pinged(self, latency: float, code: int) -> None:
        with self._lock:
            self.ping_latency_s, self.ping_code = latency, code

    def snapshot(self, **rest: Any) -> FsStats:
        with self._lock:
            return FsStats(
                gets=self.gets,
                hits=self.hits,
                misses=self.misses,
                bytes_read=self.bytes_read,
                puts=self.puts,
                bytes_written=self.bytes_written,
                coded_puts=self.coded_puts,
                coded_bytes_saved=self.coded_bytes_saved,
                evictions=self.evictions,
                evicted_gone=self.evicted_gone,
                read_ahead=self.read_ahead,
                read_in_place=self.read_in_place,
                promoted=self.promoted,
                swept=self.swept,
                scan_errors=self.scan_errors,
                get_failures=dict(self.get_failures),
                put_failures=dict(self.put_failures),
                bad_files=dict(self.bad_files),
                drops=dict(self.drops),
                ping_latency_s=self.ping_latency_s,
                ping_code=self.ping_code,
                durations={op: list(v) for op, v in self.durations.items()},
                duration_sums=dict(self.duration_sums),
                **rest,
            )
