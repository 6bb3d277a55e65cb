"""The file tier's series in `/metrics` (nothing without ``fs_path``): what it holds, what it
read and wrote, what failed (by operation and kind), what was refused and dropped, and how
long its disk calls take."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from dataplane.server.facade import DataPlaneView, FsStats


def fs_metrics(dp: DataPlaneView) -> Iterator[Metric]:
    s = dp.fs_state()
    if s is None:
        return
    bypassed = "fs" in dp.monitor_state().bypassed_backends
    for name, doc, value in _gauges(s, bypassed):
        yield GaugeMetricFamily(name, doc, value=value)
    for name, doc, value in _counters(s):
        yield CounterMetricFamily(name, doc, value=value)
    yield from _breakdowns(s.bad_files, s.get_failures, s.put_failures, s.drops)
    hist = HistogramMetricFamily(
        "kvwarden_fs_duration_seconds",
        "File-tier disk calls by operation (get: a read; exists: a LOOKUP's stat of what the index "
        "lacks; put: a write), failures and calls past the deadline included.",
        labels=["op"],
    )
    bounds = [*(f"{b:g}" for b in s.duration_buckets), "+Inf"]
    for op, counts in s.durations.items():
        running, cumulative = 0, []
        for bound, n in zip(bounds, counts, strict=True):
            running += n
            cumulative.append((bound, running))
        hist.add_metric([op], cumulative, s.duration_sums[op])
    yield hist


def _gauges(s: FsStats, bypassed: bool) -> tuple[tuple[str, str, float], ...]:
    return (
        (
            "kvwarden_fs_used_bytes",
            "Bytes of the chunk files this server knows of (headers included).",
            s.used_bytes,
        ),
        ("kvwarden_fs_capacity_bytes", "The file tier's cap (fs_size_gb) in bytes.", s.capacity_bytes),
        ("kvwarden_fs_files", "Chunk files this server knows of.", s.files),
        (
            "kvwarden_fs_rebuilt",
            "1 once the scan after start has ended (the index is whole).",
            float(s.rebuilt),
        ),
        ("kvwarden_fs_bypassed", "1 while the file tier is bypassed (local_cpu fallback).", float(bypassed)),
        (
            "kvwarden_fs_out_of_space",
            "1 while the file tier's writes are stopped because its disk is full (ENOSPC, EDQUOT); "
            "its files are still served.",
            float(s.space.out_of_space),
        ),
        (
            "kvwarden_fs_write_queue_depth",
            "Writes waiting in the file tier's write-behind queue.",
            s.queue_depth,
        ),
        (
            "kvwarden_fs_write_queue_bytes",
            "Bytes waiting in the file tier's write-behind queue.",
            s.queue_bytes,
        ),
        (
            "kvwarden_fs_stalled_seconds",
            "How long the oldest disk call in progress has run.",
            s.stalled_seconds,
        ),
        ("kvwarden_fs_probe_latency_seconds", "The last health probe's round trip.", s.ping_latency_s),
        (
            "kvwarden_fs_probe_error_code",
            "The last health probe: 0 ok, -1 timeout or stuck, -2 other.",
            s.ping_code,
        ),
    )


def _counters(s: FsStats) -> tuple[tuple[str, str, float], ...]:
    return (
        ("kvwarden_fs_hits", "Chunks read from the file tier.", s.hits),
        ("kvwarden_fs_misses", "File-tier reads that found nothing usable (bad files included).", s.misses),
        ("kvwarden_fs_read_bytes", "Chunk bytes read from the file tier.", s.bytes_read),
        ("kvwarden_fs_read_ahead", "Chunks read into L1 because a LOOKUP found them on disk.", s.read_ahead),
        (
            "kvwarden_fs_read_in_place",
            "Chunks read from the page cache straight into a worker's blocks.",
            s.read_in_place,
        ),
        ("kvwarden_fs_promoted", "Chunks read in place, then brought into L1 behind it.", s.promoted),
        ("kvwarden_fs_writes", "Chunk files written.", s.puts),
        ("kvwarden_fs_coded_writes", "Chunk files written coded (lossless).", s.coded_puts),
        ("kvwarden_fs_coded_saved_bytes", "Bytes the file tier's coding saved.", s.coded_bytes_saved),
        ("kvwarden_fs_written_bytes", "Bytes written to the file tier (headers included).", s.bytes_written),
        ("kvwarden_fs_evictions", "Chunk files removed to keep the cap (LRU).", s.evictions),
        ("kvwarden_fs_swept_files", "Stale temporary files removed (writers killed mid-write).", s.swept),
        (
            "kvwarden_fs_out_of_space_episodes",
            "Times the file tier's disk ran out of space since start.",
            s.space.episodes,
        ),
    )


def _breakdowns(
    bad: dict[str, int], gets: dict[str, int], puts: dict[str, int], drops: dict[str, int]
) -> Iterator[Metric]:
    bad_files = CounterMetricFamily(
        "kvwarden_fs_bad_files",
        "Chunk files refused, removed and never served, by kind (truncated, format, key, checksum, layout).",
        labels=["kind"],
    )
    for kind, n in bad.items():
        bad_files.add_metric([kind], n)
    yield bad_files
    failures = CounterMetricFamily(
        "kvwarden_fs_failures",
        "File-tier disk calls that failed, by operation (get: reads and lookups; put: writes and "
        "evictions) and kind (timeout, no_space, read_only, vanished, io, error).",
        labels=["op", "kind"],
    )
    for op, by in (("get", gets), ("put", puts)):
        for kind, n in by.items():
            failures.add_metric([op, kind], n)
    yield failures
    dropped = CounterMetricFamily(
        "kvwarden_fs_dropped_writes",
        "Writes to the file tier dropped, by reason (full: the queue; bypassed; stopped; no_space: "
        "the disk is full; cleared: their model's chunks were cleared).",
        labels=["reason"],
    )
    for reason, n in drops.items():
        dropped.add_metric([reason], n)
    yield dropped
