"""Assembles a running data plane from Settings, and `DataPlane`, its one read facade.

``build_dataplane`` sweeps orphaned segments, builds the storage, the server loop (which binds
at once), the transfer modules and their registries, the release path, the management module
(which owns the reaper) and the lookup module, registers every module's handlers and subscribes
the management module to the loop's connection events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from prometheus_client import generate_latest

from dataplane.events.publisher import EventsState, KVEventPublisher
from dataplane.health.base import Components
from dataplane.health.monitor import HealthMonitor
from dataplane.liveness.entry import ContextEntry, LivenessRow
from dataplane.liveness.quota import InstanceQuota
from dataplane.liveness.registry import LivenessRegistry
from dataplane.liveness.release import InstanceReleaser
from dataplane.liveness.target import InstanceLivenessTarget
from dataplane.memory.budget import ByteBudget, DescriptorReserve
from dataplane.memory.copies import CopySplitter, server_copy_ways
from dataplane.memory.shm import sweep_orphans
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import ServerInfo
from dataplane.modules.blend import BlendModule
from dataplane.modules.blend_one_copy import BlendDirectModule
from dataplane.modules.clear import ClearModule, ModelCleared
from dataplane.modules.engine_pool import EngineDrivenTransferModule
from dataplane.modules.lookup import LookupModule
from dataplane.modules.management import ManagementModule
from dataplane.modules.one_copy import DirectTransferModule
from dataplane.modules.server_driven import ServerDrivenTransferModule
from dataplane.server.config import L1Backing, Settings
from dataplane.server.facade import ComponentState, LivenessStatus, MonitorState, RemoteState
from dataplane.server.factory import new_server
from dataplane.server.kv_events import build_events
from dataplane.server.loop import Server
from dataplane.server.router_lookup import TierHits, lookup_hashes, lookup_tiers
from dataplane.storage.fs import FileTier
from dataplane.storage.fs.stats import FsStats
from dataplane.storage.l1.arena import Arena
from dataplane.storage.l1.stats import L1Stats
from dataplane.storage.lower import DURATION_BUCKETS
from dataplane.storage.remote import RemoteBackend
from dataplane.storage.tiered import TieredStore
from dataplane.wire.messages import TransferMode

logger = logging.getLogger(__name__)


@dataclass
class DataPlane:
    """The assembled data plane; implements `dataplane.server.facade.DataPlaneView`."""

    settings: Settings
    server: Server
    l1: TieredStore
    management: ManagementModule
    transfer: ServerDrivenTransferModule
    engine: EngineDrivenTransferModule
    metrics: DataPlaneMetrics
    splitter: CopySplitter
    monitor: HealthMonitor
    remote: RemoteBackend | None = None
    clock: Callable[[], float] = time.monotonic
    fs: FileTier | None = None
    events: KVEventPublisher | None = None
    clear: ClearModule | None = None

    def start(self) -> None:
        self.l1.arena.start()  # faults L1 in while the server already answers
        self.splitter.start()
        if self.remote is not None:
            self.remote.start()
        if self.fs is not None:  # its index is rebuilt in the background: PINGs are answered at once
            self.fs.start()
        if self.events is not None:
            self.events.start()
        self.server.start()
        self.monitor.start()

    def stop(self, timeout_s: float | None = None) -> bool:
        self.monitor.stop()
        self.monitor.join()
        clean = self.server.stop(timeout_s)
        self.splitter.stop()  # after the server: no transfer is left to use it
        if self.remote is not None:  # what is still queued is dropped (and released)
            self.remote.stop()
            self.remote.join()
            self.remote.close()
        if self.fs is not None:  # likewise; a thread stuck on a dead mount is left behind
            self.fs.stop()
            self.fs.join()
        if self.events is not None:  # (after the tiers: their last reports go out)
            self.events.stop()
            self.events.join()
        self.l1.close()  # last: the modules released every view of it
        return clean

    @property
    def registries(self) -> list[LivenessRegistry[Any]]:
        return [self.transfer.registry, self.engine.registry]

    # ------------------------------------------------------------------ facade
    def server_info(self) -> ServerInfo:
        return self.management.info

    def context_entries_snapshot(self) -> list[ContextEntry]:
        return [e for r in self.registries for e in r.context_entries_snapshot()]  # (sliced inside)

    def liveness_rows(self) -> list[LivenessRow]:
        if len(self.registries) == 1:
            return self.registries[0].liveness_rows()  # (sliced inside)
        return [row for r in self.registries for row in r.liveness_rows()]

    def context_entry(self, instance_id: int) -> ContextEntry | None:
        for r in self.registries:
            e = r.context_entry(instance_id)
            if e is not None:
                return e
        return None

    def holders_of(self, instance_id: int) -> list[str]:
        return [r.name for r in self.registries if r.context_entry(instance_id) is not None]

    def tracked_by_mode(self) -> dict[str, int]:
        counts = {str(m.value): 0 for m in TransferMode}
        for r in self.registries:
            counts[r.name] += r.tracked_instance_count()
        return counts

    def liveness_status(self) -> LivenessStatus:
        m = self.management
        blend = [t for t in m.releaser.targets if isinstance(t, BlendModule)]
        return LivenessStatus(
            enabled=m.reaper is not None,
            reap_timeout_seconds=m.reap_timeout_s,
            registration_grace_seconds=m.registration_grace_s,
            disconnect_grace_seconds=m.disconnect_grace_s,
            tracked_instances=m.releaser.tracked_instance_count(),
            reaped_total=m.releaser.reaped_total,
            blend_instances=sum(t.instance_count() for t in blend),
            blend_kernel=blend[0].kernels.state if blend else "idle",
        )

    def l1_stats(self) -> L1Stats:
        return self.l1.stats()

    def components(self) -> ComponentState:
        s = self.server
        err = s.loop_error
        return ComponentState(
            state=s.state.value,
            loop_alive=s.is_alive(),
            loop_error=None if err is None else repr(err),
            pools_alive=s.pools_alive(),
            reaper_alive=self.management.reaper_alive(),
        )

    def force_reap(self, instance_id: int) -> list[str]:
        return self.management.force_reap(instance_id)

    def clear_model(
        self, model: str, who: str, salt: str | None = None, adapter: str | None = None
    ) -> ModelCleared:
        assert self.clear is not None
        return self.clear.clear_model(model, who, salt, adapter)

    def monitor_state(self) -> MonitorState:
        return self.monitor.summary_state()

    def remote_state(self) -> RemoteState | None:
        b = self.remote
        if b is None:
            return None
        s = b.stats()
        return RemoteState(
            b.name,
            b.url,
            b.bypassed,
            s.ping_latency_s,
            s.ping_code,
            s.ping_successes,
            s.ping_errors,
            s.gets,
            s.hits,
            s.misses,
            sum(s.bad_values.values()),
            sum(s.get_failures.values()),
            s.puts,
            sum(s.put_failures.values()),
            s.bytes_read,
            s.bytes_written,
            s.queue_depth,
            s.queue_bytes,
            sum(s.drops.values()),
            s.space,
            tuple(
                (op, kind, n)
                for op, by in (("get", s.get_failures), ("put", s.put_failures))
                for kind, n in by.items()
            ),
            tuple((op, DURATION_BUCKETS, tuple(c), s.duration_sums[op]) for op, c in s.durations.items()),
            self.l1.remote_read_ahead,
            s.coded_puts,
            s.coded_bytes_saved,
        )

    def fs_state(self) -> FsStats | None:
        return None if self.fs is None else self.fs.stats()

    def lookup_tiers(
        self, model: str, token_ids: np.ndarray, salt: str | None = None, adapter: str | None = None
    ) -> TierHits:
        cs = self.settings.chunk_size
        return lookup_tiers(self.l1, self.registries, cs, model, token_ids, salt, adapter)

    def lookup_hashes(self, model: str, hashes: Sequence[int], block_size: int) -> TierHits:
        return lookup_hashes(self.l1, self.settings.chunk_size, model, hashes, block_size)

    def events_state(self) -> EventsState | None:
        return None if self.events is None else self.events.state()

    def render_metrics(self) -> bytes:
        return generate_latest(self.metrics.registry)


def build_dataplane(
    settings: Settings,
    clock: Callable[[], float] = time.monotonic,
    extra_targets: Sequence[InstanceLivenessTarget] = (),
    server: Server | None = None,
) -> DataPlane:
    """``extra_targets``: more liveness targets (modules holding per-instance state) beside
    the transfer modules' registries; PING touches them and every release reaches them.
    ``server``: one already bound and answering (`dataplane.server.early`), else a new one."""
    sweep_orphans()
    metrics = server.metrics if server is not None else DataPlaneMetrics()
    (remote, init_failure), (fs, fs_failure) = _remote_backend(settings), _file_tier(settings)
    l1 = _l1(settings, remote, fs)
    if server is None:
        server = new_server(settings, metrics)
    info = server.info(settings.chunk_size)
    splitter = CopySplitter(server_copy_ways())
    cs = settings.chunk_size
    quota = InstanceQuota(settings.max_instances, settings.max_instances_per_connection)
    mapped = ByteBudget("worker memory mapped", int(settings.max_mapped_gb * (1 << 30)), "max_mapped_gb")
    pools = ByteBudget("the chunk pools", int(settings.max_pool_gb * (1 << 30)), "max_pool_gb")
    fds = DescriptorReserve(held_back=server.connections.room)  # room for the connections the cap allows
    transfer = ServerDrivenTransferModule(
        l1, cs, metrics, clock, splitter=splitter, quota=quota, mapped_budget=mapped, descriptors=fds
    )
    engine = EngineDrivenTransferModule(
        l1, cs, metrics, clock, splitter=splitter, quota=quota, pool_budget=pools, descriptors=fds
    )
    blend = BlendModule(transfer, engine)
    releaser = InstanceReleaser([transfer.registry, engine.registry, blend, *extra_targets], metrics)
    management = ManagementModule(
        info,
        releaser,
        metrics,
        reap_timeout_s=settings.worker_reap_timeout_seconds,
        registration_grace_s=settings.worker_registration_grace_seconds,
        disconnect_grace_s=settings.worker_disconnect_grace_seconds,
        clock=clock,
    )
    server.add_connection_listener(management.on_connection)
    server.add_connection_listener(quota.on_connection)
    server.add_connection_listener(l1.inflight.on_connection)  # a worker gone: its stores are not coming
    lookup = LookupModule(l1, cs, metrics, [transfer.registry, engine.registry])
    clear = ClearModule(l1, metrics, [transfer.registry, engine.registry])
    direct, blend_direct = (
        DirectTransferModule(engine, l1, metrics),
        BlendDirectModule(blend, engine, l1, metrics),
    )
    for module in (management, transfer, engine, direct, blend, blend_direct, lookup, clear):
        server.add_module(module)
    events = build_events(settings, l1, remote, fs)
    monitor = _monitor(settings, l1, remote, fs, _self_checks(server, management), clock, events)
    if init_failure or fs_failure:
        monitor.mark_init_failed(str(init_failure or fs_failure))
    l1.gate = monitor.is_healthy
    parts = (server, l1, management, transfer, engine, metrics, splitter, monitor, remote, clock, fs, events)
    return DataPlane(settings, *parts, clear)


def _l1(settings: Settings, remote: RemoteBackend | None, fs: FileTier | None) -> TieredStore:
    """L1 over its arena, with the file and remote tiers beneath it when there are."""
    shared = {L1Backing.AUTO: None, L1Backing.SHM: True, L1Backing.PRIVATE: False}[settings.l1_backing]
    arena = Arena(settings.l1_capacity_bytes, shared=shared, pin_memory=torch.cuda.is_available())
    logger.info("kvwarden: L1 arena of %d bytes, %s", arena.capacity, arena.backing)
    return TieredStore(
        settings.l1_capacity_bytes,
        hot_cache=settings.local_cpu,
        arena=arena,
        remote=remote,
        tenant_share_bytes=settings.l1_tenant_share_bytes,
        fs=fs,
        policy=settings.l1_eviction.value,
    )


def _file_tier(settings: Settings) -> tuple[FileTier | None, str | None]:
    """The file tier (None without fs_path), and why it could not be built."""
    if settings.fs_path is None:
        return None, None
    try:
        tier = FileTier(
            str(settings.fs_path),
            int(settings.fs_size_gb * (1 << 30)),
            timeout_s=settings.fs_timeout_seconds,
            queue_bytes=settings.fs_write_queue_mb << 20,
            health_timeout_s=settings.health_ping_timeout,
            eviction=settings.fs_eviction.value,
            compression=settings.fs_compression,
        )
    except Exception as exc:  # the server still serves: recompute-only, unhealthy
        return None, f"the file tier could not be set up: {type(exc).__name__}: {exc}"
    logger.info("kvwarden: file tier %s, %d bytes", tier.root, tier.capacity_bytes)
    return tier, None


def _remote_backend(settings: Settings) -> tuple[RemoteBackend | None, str | None]:
    """The remote tier's backend (None without remote_url), and why it could not be built."""
    if settings.remote_url is None:
        return None, None
    password = settings.remote_password
    try:
        backend = RemoteBackend(
            settings.remote_url,
            password=None if password is None else password.get_secret_value(),
            timeout_s=settings.remote_timeout_seconds,
            prefix=settings.remote_key_prefix,
            queue_bytes=settings.remote_write_queue_mb << 20,
            health_timeout_s=settings.health_ping_timeout,
            compression=settings.remote_compression,
        )
    except Exception as exc:  # the server still serves: recompute-only, unhealthy
        return None, f"the remote tier could not be set up: {type(exc).__name__}"
    logger.info("kvwarden: remote tier %s", backend.url)
    return backend, None


def _self_checks(server: Server, management: ManagementModule) -> dict[str, Callable[[], str | None]]:
    """The data plane's own parts, as live checks of the health monitor (each reads a flag)."""

    def loop() -> str | None:
        if server.loop_error is not None:
            return f"loop thread died: {server.loop_error!r}"
        if not server.is_alive():
            return f"loop thread is not running (server {server.state.value})"
        return None

    def pools() -> str | None:
        return None if server.pools_alive() else "worker pools shut down"

    def reaper() -> str | None:
        return None if management.reaper_alive() else "worker reaper thread is not running"

    checks = {"dataplane:loop": loop, "dataplane:pools": pools}
    if management.reaper_alive() is not None:  # reaping on
        checks["dataplane:reaper"] = reaper
    return checks


def _monitor(
    settings: Settings,
    l1: TieredStore,
    remote: RemoteBackend | None,
    fs: FileTier | None,
    self_checks: dict[str, Callable[[], str | None]],
    clock: Callable[[], float],
    events: KVEventPublisher | None = None,
) -> HealthMonitor:
    components = Components(
        remote_backends={} if remote is None else {remote.name: remote},
        fs_tiers={} if fs is None else {fs.name: fs},
        local_tier=l1,
        self_checks=self_checks,
        fallback_policy=settings.fallback_policy,
        get_blocking_failed_threshold=settings.get_blocking_failed_threshold,
        waiting_time_for_recovery=settings.waiting_time_for_recovery,
        clock=clock,
        on_unhealthy=None if events is None else events.sink.cleared,  # (nothing is served then)
    )
    monitor = HealthMonitor(components, settings.health_ping_interval)
    if remote is not None:  # a burst of failed reads: a round at once, not at the interval's end
        remote.burst_at, remote.on_burst = settings.get_blocking_failed_threshold, monitor.request_round
    if fs is not None:
        fs.counters.burst_at, fs.counters.on_burst = (
            settings.get_blocking_failed_threshold,
            monitor.request_round,
        )
    return monitor
