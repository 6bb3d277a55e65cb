"""The one read facade of the data plane: everything the HTTP sidecar may see or do.

`DataPlaneView` is a Protocol: `dataplane.server.runtime.DataPlane` implements it, and the
sidecar's tests can serve the app over a fake. Every method is safe from any thread: each reads
through a module's locked accessor (a leaf lock, taken, copied, let go) and returns copies or
immutable values, never a structure the data plane mutates.

The health types are the health monitor's own (`dataplane.health`), re-exported here:
`CheckResult`, one check's result, which the sidecar's own checks return too, and `MonitorState`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dataplane.events.publisher import EventsState
from dataplane.health.base import CheckResult, Status
from dataplane.health.monitor import MonitorState
from dataplane.liveness.entry import ContextEntry, LivenessRow
from dataplane.modules.base import ServerInfo
from dataplane.modules.clear import ModelCleared
from dataplane.server.config import Settings
from dataplane.server.router_lookup import TierHits
from dataplane.storage.fs.stats import FsStats
from dataplane.storage.l1.stats import L1Stats
from dataplane.storage.l1.tenants import TenantStats
from dataplane.storage.lower import SpaceState

__all__ = [
    "CheckResult",
    "ComponentState",
    "ContextEntry",
    "DataPlaneView",
    "EventsState",
    "FsStats",
    "L1Stats",
    "LivenessRow",
    "LivenessStatus",
    "ModelCleared",
    "MonitorState",
    "RemoteState",
    "ServerInfo",
    "SpaceState",
    "Status",
    "TenantStats",
    "TierHits",
]


@dataclass(frozen=True, slots=True)
class RemoteState:
    """The remote tier's backend as `/status` and `/metrics` show it (the URL has no password)."""

    backend: str
    url: str
    bypassed: bool
    ping_latency_seconds: float
    ping_error_code: int
    ping_successes: int
    ping_errors: int
    gets: int
    hits: int
    misses: int
    bad_values: int
    get_failures: int
    puts: int
    put_failures: int
    bytes_read: int
    bytes_written: int
    queue_depth: int
    queue_bytes: int
    dropped_writes: int
    space: SpaceState  # writes stopped while Redis answers OOM
    failures: tuple[tuple[str, str, int], ...] = ()  # (op: get or put, kind, count)
    # (op, upper bounds in seconds, counts per bucket with +Inf last, sum of seconds)
    durations: tuple[tuple[str, tuple[float, ...], tuple[int, ...], float], ...] = ()
    read_ahead: int = 0  # chunks read into L1 ahead of a RETRIEVE because a LOOKUP found them in Redis
    coded_puts: int = 0  # chunks written coded (`dataplane.storage.compress`)
    coded_bytes_saved: int = 0  # what coding them saved, against their raw size


@dataclass(frozen=True, slots=True)
class LivenessStatus:
    """``worker_liveness`` of `/status`."""

    enabled: bool
    reap_timeout_seconds: float
    registration_grace_seconds: float
    disconnect_grace_seconds: float
    tracked_instances: int
    reaped_total: int
    blend_instances: int = 0  # instances holding blend state (RoPE tables)
    blend_kernel: str = "idle"  # the compiled rotation: idle, compiling, ready, unavailable: <why>


@dataclass(frozen=True, slots=True)
class ComponentState:
    """Whether each of the data plane's threads is doing its job (read from flags only)."""

    state: str  # the server lifecycle: created, running, draining, stopped
    loop_alive: bool
    loop_error: str | None  # repr of what killed the loop thread, if it died
    pools_alive: bool
    reaper_alive: bool | None  # None: reaping is disabled


class DataPlaneView(Protocol):
    @property
    def settings(self) -> Settings: ...

    def server_info(self) -> ServerInfo: ...

    def clock(self) -> float:
        """The monotonic clock the liveness fields are read against."""
        ...

    def context_entries_snapshot(self) -> list[ContextEntry]:
        """Every tracked instance of every transfer module (each read under its own lock)."""
        ...

    def liveness_rows(self) -> list[LivenessRow]:
        """(instance_id, registered_at, last_seen, has_liveness_signal, disconnected) of every
        tracked instance, in the order of `context_entries_snapshot`: what changes while an
        instance lives (the rest is fixed at registration: `context_entry`)."""
        ...

    def context_entry(self, instance_id: int) -> ContextEntry | None: ...

    def holders_of(self, instance_id: int) -> list[str]:
        """Names of the modules tracking ``instance_id`` (what a reap would release)."""
        ...

    def tracked_by_mode(self) -> dict[str, int]:
        """Tracked instances per transfer mode, every mode present (0 when none)."""
        ...

    def liveness_status(self) -> LivenessStatus: ...

    def l1_stats(self) -> L1Stats: ...

    def components(self) -> ComponentState: ...

    def monitor_state(self) -> MonitorState:
        """The health monitor: overall health, each check's last result, bypassed backends."""
        ...

    def remote_state(self) -> RemoteState | None:
        """The remote tier (None: no remote_url)."""
        ...

    def fs_state(self) -> FsStats | None:
        """The file tier (None: no fs_path)."""
        ...

    def events_state(self) -> EventsState | None:
        """The KV events (None: no kv_events_endpoint)."""
        ...

    def lookup_hashes(self, model: str, hashes: Sequence[int], block_size: int) -> TierHits:
        """A router's lookup by the engine's block hashes (`dataplane.server.router_lookup`)."""
        ...

    def lookup_tiers(
        self, model: str, token_ids: np.ndarray, salt: str | None = None, adapter: str | None = None
    ) -> TierHits:
        """A router's lookup (`dataplane.server.router_lookup`); blocking calls to the lower
        tiers, each bounded by its deadline: never on the loop thread."""
        ...

    def force_reap(self, instance_id: int) -> list[str]:
        """The admin reap (the cleanup UNREGISTER runs); names of the modules that held it."""
        ...

    def clear_model(
        self, model: str, who: str, salt: str | None = None, adapter: str | None = None
    ) -> ModelCleared:
        """The admin clear: every chunk of ``model``'s scopes (those its instances registered
        since start), or of them those of ``salt``, of ``adapter`` (LookupError: not known) or
        both, leaves every tier (`dataplane.modules.clear`); blocking (the disk, Redis): never
        on the loop thread. ``who`` names the caller in the log."""
        ...

    def render_metrics(self) -> bytes:
        """The data plane's own metrics, Prometheus text format."""
        ...
