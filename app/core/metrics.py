"""Scrape-time gauges and the `/metrics` registries.

The data plane counts what happens on its own registry (`dataplane.metrics`). Gauges that
mirror state are read here, at scrape time, through locked accessors, so the hot path pays
nothing for them. Each app has a registry of its own (tests build many apps in one process;
the global ``REGISTRY`` is never used) holding this collector and the HTTP metrics of
prometheus-fastapi-instrumentator. No metric has a per-instance label.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from app.core.events_metrics import events_metrics
from app.core.fs_metrics import fs_metrics
from app.core.health import HealthChecker

if TYPE_CHECKING:
    from dataplane.server.facade import DataPlaneView, L1Stats, RemoteState, TenantStats


class DataPlaneStateCollector(Collector):
    def __init__(self, dp: DataPlaneView, health: HealthChecker) -> None:
        self._dp = dp
        self._health = health

    def collect(self) -> Iterator[Metric]:
        dp = self._dp
        yield GaugeMetricFamily(
            "kvwarden_healthy",
            "1 while no health check fails, else 0.",
            value=1.0 if self._health.run().is_healthy else 0.0,
        )
        tracked = GaugeMetricFamily(
            "kvwarden_tracked_instances",
            "Worker instances tracked, by transfer mode.",
            labels=["transfer_mode"],
        )
        for mode, n in dp.tracked_by_mode().items():
            tracked.add_metric([mode], n)
        yield tracked
        stats = dp.l1_stats()
        yield GaugeMetricFamily(
            "kvwarden_l1_used_bytes",
            "Bytes of L1 held by committed and reserved chunks.",
            value=stats.used_bytes,
        )
        yield GaugeMetricFamily(
            "kvwarden_l1_capacity_bytes", "L1 capacity in bytes.", value=stats.capacity_bytes
        )
        yield CounterMetricFamily(
            "kvwarden_l1_evictions", "Chunks evicted from L1 (in l1_eviction's order).", value=stats.evictions
        )
        yield from l1_metrics(stats)
        yield GaugeMetricFamily(
            "kvwarden_inflight_chunks",
            "Chunks being stored now (written, not yet committed): lookups count them as pending.",
            value=stats.inflight_chunks,
        )
        yield GaugeMetricFamily(
            "kvwarden_inflight_stores", "Stores writing chunks now.", value=stats.inflight_stores
        )
        yield from tenant_metrics(stats.tenants or [])
        yield from fs_metrics(dp)
        yield from remote_metrics(dp)
        yield from events_metrics(dp)


def l1_metrics(stats: L1Stats) -> Iterator[Metric]:
    """What L1 serves and why it evicts (the file and remote tiers count their own hits)."""
    yield CounterMetricFamily(
        "kvwarden_l1_hits",
        "Chunks requests found in L1 (not those a lower tier brought in for them: that tier's hits).",
        value=stats.hits,
    )
    by_reason = CounterMetricFamily(
        "kvwarden_l1_evictions_by_reason",
        "Chunks evicted from L1 by reason: capacity (the next in l1_eviction's order, to make room), "
        "tenant_share (a tenant's own, to keep it within l1_tenant_share).",
        labels=["reason"],
    )
    for reason, n in stats.evictions_by_reason().items():
        by_reason.add_metric([reason], n)
    yield by_reason


def tenant_metrics(tenants: list[TenantStats]) -> Iterator[Metric]:
    """L1 by tenant: the tenants holding most (a keyed digest of their salt, never the salt),
    the rest under ``other``, so the series stay few however many tenants there are. A
    tenant's counts start again when it has held nothing for a while (it is forgotten)."""
    held = GaugeMetricFamily("kvwarden_l1_tenant_bytes", "Bytes of L1 a tenant holds.", labels=["tenant"])
    hits = CounterMetricFamily(
        "kvwarden_l1_tenant_hits", "A tenant's chunks served to it.", labels=["tenant"]
    )
    evicted = CounterMetricFamily(
        "kvwarden_l1_tenant_evictions", "A tenant's chunks evicted.", labels=["tenant"]
    )
    for t in tenants:
        held.add_metric([t.tenant], t.bytes)
        hits.add_metric([t.tenant], t.hits)
        evicted.add_metric([t.tenant], t.evictions)
    yield from (held, hits, evicted)


def remote_metrics(dp: DataPlaneView) -> Iterator[Metric]:
    """The remote tier, labelled by backend (nothing without one)."""
    r = dp.remote_state()
    if r is None:
        return
    lb = [r.backend]
    for name, doc, value in _remote_gauges(r):
        g = GaugeMetricFamily(name, doc, labels=["backend"])
        g.add_metric(lb, value)
        yield g
    for name, doc, value in _remote_counters(r):
        c = CounterMetricFamily(name, doc, labels=["backend"])
        c.add_metric(lb, value)
        yield c
    yield from _remote_breakdowns(r)


def _remote_gauges(r: RemoteState) -> tuple[tuple[str, str, float], ...]:
    return (
        (
            "kvwarden_backend_bypassed",
            "1 while the backend is bypassed (local_cpu fallback).",
            float(r.bypassed),
        ),
        (
            "kvwarden_remote_ping_latency_seconds",
            "The last health PING's round trip.",
            r.ping_latency_seconds,
        ),
        (
            "kvwarden_remote_ping_error_code",
            "The last health PING: 0 ok, -1 timeout, -2 other.",
            r.ping_error_code,
        ),
        ("kvwarden_remote_write_queue_depth", "Writes waiting in the write-behind queue.", r.queue_depth),
        ("kvwarden_remote_write_queue_bytes", "Bytes waiting in the write-behind queue.", r.queue_bytes),
        (
            "kvwarden_remote_out_of_space",
            "1 while writes to the remote tier are stopped because Redis answers OOM (maxmemory, "
            "noeviction); reads go on.",
            float(r.space.out_of_space),
        ),
    )


def _remote_counters(r: RemoteState) -> tuple[tuple[str, str, float], ...]:
    return (
        ("kvwarden_remote_ping_successes", "Health PINGs answered.", r.ping_successes),
        ("kvwarden_remote_ping_errors", "Health PINGs that failed or timed out.", r.ping_errors),
        (
            "kvwarden_remote_get_failures",
            "Remote reads that failed (timeouts, connection, auth, errors).",
            r.get_failures,
        ),
        ("kvwarden_remote_put_failures", "Remote writes that failed.", r.put_failures),
        ("kvwarden_remote_gets", "Remote reads answered (hits and misses).", r.gets),
        ("kvwarden_remote_hits", "Chunks read from the remote tier.", r.hits),
        (
            "kvwarden_remote_read_ahead",
            "Chunks read into L1 ahead of a RETRIEVE, because a LOOKUP found them in the remote tier.",
            r.read_ahead,
        ),
        ("kvwarden_remote_bad_values", "Remote values refused (truncated, damaged, foreign).", r.bad_values),
        ("kvwarden_remote_puts", "Chunks written to the remote tier.", r.puts),
        ("kvwarden_remote_read_bytes", "Chunk bytes read from the remote tier.", r.bytes_read),
        ("kvwarden_remote_written_bytes", "Bytes written to the remote tier.", r.bytes_written),
        ("kvwarden_remote_coded_puts", "Chunks written to the remote tier coded (lossless).", r.coded_puts),
        (
            "kvwarden_remote_coded_saved_bytes",
            "Bytes the remote tier's coding saved against the raw size of the chunks it coded.",
            r.coded_bytes_saved,
        ),
        (
            "kvwarden_remote_dropped_writes",
            "Writes dropped (queue full, bypassed, shutdown, out of space, their model's chunks cleared).",
            r.dropped_writes,
        ),
        (
            "kvwarden_remote_out_of_space_episodes",
            "Times the remote tier ran out of space (Redis answering OOM) since start.",
            r.space.episodes,
        ),
    )


def _remote_breakdowns(r: RemoteState) -> Iterator[Metric]:
    """Failures by operation and kind; call durations by operation (a histogram)."""
    by_kind = CounterMetricFamily(
        "kvwarden_remote_failures",
        "Remote calls that failed, by operation (get: reads and lookups; put) and kind "
        "(timeout, connection, auth, error).",
        labels=["backend", "op", "kind"],
    )
    for op, kind, n in r.failures:
        by_kind.add_metric([r.backend, op, kind], n)
    yield by_kind
    hist = HistogramMetricFamily(
        "kvwarden_remote_duration_seconds",
        "Remote calls by operation (get; exists: a LOOKUP's pipelined round trip; put), failures included.",
        labels=["backend", "op"],
    )
    for op, bounds, counts, total in r.durations:
        cumulative, running = [], 0
        for bound, n in zip([*(f"{b:g}" for b in bounds), "+Inf"], counts, strict=True):
            running += n
            cumulative.append((bound, running))
        hist.add_metric([r.backend, op], cumulative, total)
    yield hist


def render_metrics(dp: DataPlaneView, app_registry: CollectorRegistry) -> bytes:
    """Prometheus text format: the data plane's registry, then the app's."""
    return dp.render_metrics() + generate_latest(app_registry)
