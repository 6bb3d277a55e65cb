"""The remote tier: chunks in a Redis (or Valkey, or Redis Cluster) that many servers share.

Door: `RemoteBackend` (`backend`), its snapshot `RemoteStats` (`stats`), `RemoteAuthError`.
Inside: `redis_client` (clients made with one try per call, URLs redacted, failures sorted by
kind), `direct` (GETs received straight into the buffer a chunk lands in), `read_ahead` (the
reader thread of queued GETs), `clear` (a scope's chunks found and removed: SCAN, UNLINK),
`health` (PING, the probe, and whether there is room again once Redis ran out of it).

It may import `dataplane.events` and, of storage, only `codec` and `lower`: never the wire, L1
or the file tier (import-linter keeps it so).
"""

from __future__ import annotations

from dataplane.storage.remote.backend import RemoteAuthError, RemoteBackend
from dataplane.storage.remote.stats import RemoteStats

__all__ = ["RemoteAuthError", "RemoteBackend", "RemoteStats"]
