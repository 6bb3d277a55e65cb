"""The remote tier's counters: `RemoteStats`, a snapshot of one backend's (a copy), which
/metrics and /status read."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dataplane.storage.lower import DROP_REASONS, DURATION_BUCKETS, OK, OPS, SpaceState

FAILURE_KINDS = ("timeout", "connection", "auth", "no_space", "error")
# why a write was dropped: the lower tiers' reasons, and "cleared" (its scope was cleared while
# it waited in the queue: `RemoteBackend.clear_scope`)
REMOTE_DROP_REASONS = (*DROP_REASONS, "cleared")


@dataclass
class RemoteStats:
    """Counters of one backend (a snapshot is a copy)."""

    gets: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    puts: int = 0
    bytes_written: int = 0  # as stored: headers, and payloads coded or not
    coded_puts: int = 0  # chunks written coded (`dataplane.storage.compress`)
    coded_bytes_saved: int = 0  # what coding them saved, against their raw size
    get_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_KINDS, 0))
    put_failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_KINDS, 0))
    bad_values: dict[str, int] = field(default_factory=dict)  # codec kinds
    drops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REMOTE_DROP_REASONS, 0))
    queue_depth: int = 0
    queue_bytes: int = 0
    ping_latency_s: float = 0.0
    ping_code: int = OK
    ping_successes: int = 0
    ping_errors: int = 0
    # op -> counts per bucket of DURATION_BUCKETS (+Inf last), and the sum of the durations
    durations: dict[str, list[int]] = field(
        default_factory=lambda: {op: [0] * (len(DURATION_BUCKETS) + 1) for op in OPS}
    )
    duration_sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(OPS, 0.0))
    space: SpaceState = field(default_factory=lambda: SpaceState(False, "", 0.0, 0, 0))
    cleared: int = 0  # chunks removed from Redis by `RemoteBackend.clear_scope`

    def count_put(self, stored: int, saved: int | None) -> None:
        """A chunk written, ``stored`` bytes with its header; ``saved``: what coding it saved
        (None: written raw)."""
        self.puts += 1
        self.bytes_written += stored
        if saved is not None:
            self.coded_puts += 1
            self.coded_bytes_saved += saved

    def copy(self, queue_depth: int, queue_bytes: int, space: SpaceState) -> RemoteStats:
        """A snapshot: these counters (nothing shared with them), with the queue and space now."""
        return replace(
            self,
            get_failures=dict(self.get_failures),
            put_failures=dict(self.put_failures),
            bad_values=dict(self.bad_values),
            drops=dict(self.drops),
            queue_depth=queue_depth,
            queue_bytes=queue_bytes,
            durations={op: list(c) for op, c in self.durations.items()},
            duration_sums=dict(self.duration_sums),
            space=space,
        )
