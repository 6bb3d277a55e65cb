"""The data plane's server, made from the settings: bound at once, before anything else is built
(`kvwarden serve` makes it first, for a staged start: `dataplane.server.early`). This module
imports no torch.
"""

from __future__ import annotations

from dataplane.metrics import DataPlaneMetrics
from dataplane.server.config import Settings, fd_limit
from dataplane.server.loop import Server


def new_server(settings: Settings, metrics: DataPlaneMetrics | None = None) -> Server:
    """The data plane's server, bound (OSError when the endpoint cannot be), its connections
    capped under the open-files limit as it is now (ValueError when the cap cannot be honoured:
    `Settings.connection_cap`). Without ``metrics``, the server makes the data plane's."""
    return Server(
        settings.zmq_endpoint,
        max_cpu_workers=settings.max_cpu_workers,
        max_transfer_workers=settings.max_transfer_workers,
        max_frame_bytes=settings.max_frame_bytes,
        metrics=metrics,
        max_connections=settings.connection_cap(fd_limit()),
    )
