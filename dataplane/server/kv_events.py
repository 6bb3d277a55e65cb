"""The KV events of a data plane (`dataplane.events`): a sink every tier reports to, and the
publisher, when ``kv_events_endpoint`` is set; the health monitor's fallback withdraws what a
bypassed tier held, and a server turned unhealthy (nothing served) clears everything."""

from __future__ import annotations

from dataplane.events.publisher import KVEventPublisher
from dataplane.events.sink import EventSink
from dataplane.server.config import Settings
from dataplane.storage.fs import FileTier
from dataplane.storage.remote import RemoteBackend
from dataplane.storage.tiered import TieredStore


def build_events(
    settings: Settings, l1: TieredStore, remote: RemoteBackend | None, fs: FileTier | None
) -> KVEventPublisher | None:
    """The publisher, its sockets bound (ValueError naming the endpoint that cannot be), every
    tier reporting to its sink; None with events off."""
    if settings.kv_events_endpoint is None:
        return None
    sink = EventSink()
    pub = KVEventPublisher(
        sink, settings.kv_events_endpoint, settings.kv_events_replay_endpoint, settings.kv_events_topic
    )
    pub.bind()
    for tier in (l1, remote, fs):
        if tier is not None:
            tier.events = sink
    return pub
