"""kvwarden data plane: ZMQ protocol, server loop, transfer modules, storage tiers, worker client."""

from __future__ import annotations

__version__ = "0.1.0"
# the name this project is installed under (`pip install kvwarden-server`); `kvwarden` on the
# package index is another, unrelated project
DISTRIBUTION = "kvwarden-server"
