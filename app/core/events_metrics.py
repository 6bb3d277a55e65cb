"""The KV events' series in `/metrics` (nothing without ``kv_events_endpoint``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from dataplane.server.facade import DataPlaneView


def events_metrics(dp: DataPlaneView) -> Iterator[Metric]:
    s = dp.events_state()
    if s is None:
        return
    published = CounterMetricFamily(
        "kvwarden_kv_events",
        "KV events published, by type (BlockStored, BlockRemoved, AllBlocksCleared).",
        labels=["type"],
    )
    for t, n in (("BlockStored", s.stored), ("BlockRemoved", s.removed), ("AllBlocksCleared", s.cleared)):
        published.add_metric([t], n)
    yield published
    yield CounterMetricFamily("kvwarden_kv_event_batches", "Event batches published.", value=s.batches)
    yield CounterMetricFamily(
        "kvwarden_kv_events_dropped",
        "Tier changes that did not fit the events queue (subscribers were then told AllBlocksCleared).",
        value=s.dropped,
    )
    yield CounterMetricFamily("kvwarden_kv_event_replays", "Replay requests answered.", value=s.replays)
    yield GaugeMetricFamily(
        "kvwarden_kv_events_queued", "Tier changes waiting to be published.", value=s.queued
    )
    yield GaugeMetricFamily(
        "kvwarden_kv_events_held_chunks", "Chunks the events announce as held (on any medium).", value=s.held
    )
    yield GaugeMetricFamily(
        "kvwarden_kv_events_publisher_up", "1 while the publisher thread runs.", value=float(s.alive)
    )
