"""Assembles a running data plane from Settings: storage, modules, the server loop."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dataplane.config import Settings
from dataplane.kvmemory import CopySplitter
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.engine import EngineDrivenTransferModule
from dataplane.modules.lookup import LookupModule
from dataplane.modules.management import ManagementModule
from dataplane.modules.registry import ContextEntry
from dataplane.modules.transfer import ServerDrivenTransferModule
from dataplane.server import Server
from dataplane.shm import sweep_orphans
from dataplane.storage.l1 import L1Store

logger = logging.getLogger(__name__)


@dataclass
class DataPlane:
    settings: Settings
    server: Server
    l1: L1Store
    management: ManagementModule
    transfer: ServerDrivenTransferModule
    engine: EngineDrivenTransferModule
    metrics: DataPlaneMetrics
    splitter: CopySplitter
    clock: Callable[[], float] = time.monotonic
    swept_segments: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.splitter.start()
        self.server.start()

    def stop(self, timeout_s: float | None = None) -> bool:
        clean = self.server.stop(timeout_s)
        self.splitter.stop()  # after the server: no transfer is left to use it
        return clean

    @property
    def transfer_modules(self) -> list[ServerDrivenTransferModule | EngineDrivenTransferModule]:
        return [self.transfer, self.engine]

    def context_entries_snapshot(self) -> list[ContextEntry]:
        """Every tracked instance of every transfer module (each read under its own lock)."""
        return [e for m in self.transfer_modules for e in m.context_entries_snapshot()]

    def context_entry(self, instance_id: int) -> ContextEntry | None:
        for m in self.transfer_modules:
            e = m.context_entry(instance_id)
            if e is not None:
                return e
        return None


def build_dataplane(settings: Settings, clock: Callable[[], float] = time.monotonic) -> DataPlane:
    swept = sweep_orphans()
    if settings.remote_url:
        logger.warning("kvwarden: remote_url is set, but this version serves the local CPU tier "
                       "only; the remote tier is not used")
    metrics = DataPlaneMetrics()
    l1 = L1Store(settings.l1_capacity_bytes, hot_cache=settings.local_cpu,
                 pin_memory=torch.cuda.is_available())
    server = Server(
        settings.zmq_endpoint,
        max_cpu_workers=settings.max_cpu_workers,
        max_transfer_workers=settings.max_transfer_workers,
        max_frame_bytes=settings.max_frame_bytes,
        metrics=metrics,
    )
    splitter = CopySplitter(min(os.cpu_count() or 1, 4))
    transfer = ServerDrivenTransferModule(l1, settings.chunk_size, metrics, clock,
                                          splitter=splitter)
    engine = EngineDrivenTransferModule(l1, settings.chunk_size, metrics, clock, splitter=splitter)
    management = ManagementModule(
        server, settings.chunk_size, targets=[transfer, engine],
        reap_timeout_s=settings.worker_reap_timeout_seconds,
        registration_grace_s=settings.worker_registration_grace_seconds,
        disconnect_grace_s=settings.worker_disconnect_grace_seconds,
        clock=clock,
    )
    server.add_module(management)
    server.add_module(transfer)
    server.add_module(engine)
    server.add_module(LookupModule(l1, settings.chunk_size, metrics, [transfer, engine]))
    return DataPlane(settings, server, l1, management, transfer, engine, metrics, splitter, clock,
                     swept)
