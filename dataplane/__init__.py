"""kvwarden data plane: ZMQ protocol, server loop, transfer modules, storage tiers, worker client."""

from __future__ import annotations

__version__ = "0.1.0"
