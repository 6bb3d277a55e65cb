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
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.core.health import HealthChecker

if TYPE_CHECKING:
    from dataplane.server.facade import DataPlaneView


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
            "kvwarden_l1_evictions", "Chunks evicted from L1 (LRU).", value=stats.evictions
        )


def render_metrics(dp: DataPlaneView, app_registry: CollectorRegistry) -> bytes:
    """Prometheus text format: the data plane's registry, then the app's."""
    return dp.render_metrics() + generate_latest(app_registry)
