"""Data-plane metrics on a registry of their own (tests build many servers in one process).

Counters and histograms are updated where things happen; gauges that mirror state (L1 bytes,
tracked instances, health) are read through locked accessors at scrape time by collectors that
the sidecar registers, so the hot path pays nothing for them. The connection gauges are the
exception: the loop thread sets them as connections open and close (never on a request).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dataplane.wire.messages import WAIT_OUTCOMES, MsgType

# sub-millisecond resolution for PING/LOOKUP, up to seconds for big transfers
DURATION_BUCKETS = (
    50e-6,
    100e-6,
    200e-6,
    500e-6,
    1e-3,
    2e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
WAIT_BUCKETS = (1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REAP_REASONS = ("timeout", "grace", "disconnect", "admin")
# what a LIMIT_EXCEEDED refusal met (dataplane.wire.errors.LimitExceeded.limit)
LIMITS = (
    "max_instances", "max_instances_per_connection", "max_pool_gb", "max_mapped_gb",
    "descriptors", "segment_space", "leases", "other",
)  # fmt: skip


class DataPlaneMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.pings = Counter("kvwarden_pings", "PING requests answered.", registry=r)
        self.requests = Counter(
            "kvwarden_requests",
            "Requests by type and outcome (ok, error).",
            ["type", "outcome"],
            registry=r,
        )
        self.duration = Histogram(
            "kvwarden_request_duration_seconds",
            "Request handling time by type.",
            ["type"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "kvwarden_transfer_bytes",
            "KV bytes copied, by direction (store, retrieve).",
            ["direction"],
            registry=r,
        )
        self.lookup_tokens = Counter("kvwarden_lookup_tokens", "Tokens asked about.", registry=r)
        self.hit_tokens = Counter("kvwarden_hit_tokens", "Tokens found stored.", registry=r)
        self.prefetches = Counter(
            "kvwarden_prefetches",
            "PREFETCH_SCOPE requests: prompts whose prefix a scheduler asked to be read ahead into L1.",
            registry=r,
        )
        self.reaped = Counter(
            "kvwarden_instances_reaped", "Instances reaped, by reason.", ["reason"], registry=r
        )
        self.rejected_chunks = Counter(
            "kvwarden_store_rejected_chunks",
            "Chunks a STORE could not write (L1 full).",
            registry=r,
        )
        self.limits_exceeded = Counter(
            "kvwarden_limits_exceeded",
            "Requests refused with LIMIT_EXCEEDED, by the limit they met.",
            ["limit"],
            registry=r,
        )
        self.not_owner = Counter(
            "kvwarden_not_owner_refusals", "Requests refused with NOT_OWNER (a wrong secret).", registry=r
        )
        self._connection_metrics(r)
        self._wait_metrics(r)
        self._clear_metrics(r)
        for limit in LIMITS:
            self.limits_exceeded.labels(limit=limit)
        for reason in REAP_REASONS:
            self.reaped.labels(reason=reason)
        for d in ("store", "retrieve"):
            self.transfer_bytes.labels(direction=d)
        for t in MsgType:  # every series exists from the start: dashboards see 0, not nothing
            self.duration.labels(type=t.value)
            for outcome in ("ok", "error"):
                self.requests.labels(type=t.value, outcome=outcome)

    def _clear_metrics(self, r: CollectorRegistry) -> None:
        """Clears of a model's chunks (`dataplane.modules.clear`)."""
        self.clears = Counter(
            "kvwarden_cache_clears",
            "Clears of a model's chunks (an engine's CLEAR_SCOPE, the admin POST /v1/cache/clear), "
            "by origin and outcome (complete, incomplete: a tier failed or a chunk stayed pinned).",
            ["origin", "outcome"],
            registry=r,
        )
        self.cleared_chunks = Counter(
            "kvwarden_cleared_chunks",
            "Chunks clears removed, by tier (l1, fs, remote).",
            ["tier"],
            registry=r,
        )
        for origin in ("engine", "admin"):
            for outcome in ("complete", "incomplete"):
                self.clears.labels(origin=origin, outcome=outcome)
        for tier in ("l1", "fs", "remote"):
            self.cleared_chunks.labels(tier=tier)

    def _wait_metrics(self, r: CollectorRegistry) -> None:
        """Lookups that found chunks being stored, and the waits schedulers report (LOOKUP_WAITED)."""
        self.pending_tokens = Counter(
            "kvwarden_lookup_pending_tokens",
            "Tokens lookups found being stored (not yet committed) after the tokens held.",
            registry=r,
        )
        self.lookup_waits = Counter(
            "kvwarden_lookup_waits",
            "Requests a scheduler held back for chunks being stored, by how the wait ended "
            "(hit: all landed; partial: some did; gave_up: its bound passed first).",
            ["outcome"],
            registry=r,
        )
        self.lookup_wait_seconds = Histogram(
            "kvwarden_lookup_wait_seconds",
            "How long a scheduler held a request back for chunks being stored.",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        for outcome in WAIT_OUTCOMES:
            self.lookup_waits.labels(outcome=outcome)

    def _connection_metrics(self, r: CollectorRegistry) -> None:
        """Set by the loop thread as connections open and close (`dataplane.server.connections`)."""
        self.connections_open = Gauge(
            "kvwarden_connections_open", "Data-plane connections open and served.", registry=r
        )
        self.connections_max = Gauge(
            "kvwarden_connections_max", "The cap on data-plane connections (max_connections).", registry=r
        )
        self.connections_refused = Counter(
            "kvwarden_connections_refused",
            "Data-plane connections closed as soon as accepted: max_connections were open.",
            registry=r,
        )
