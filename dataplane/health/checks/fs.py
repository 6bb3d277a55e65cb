"""One check per file tier, each round: the remote check's steps (`checks.remote`) on the disk.

1. In a recovery window (failed disk calls tripped the threshold): healthy only once it has
   passed **and** a probe file round-trips.
2. Failed disk calls since the last round (timeouts, EIO, a read-only or vanished directory;
   never a plain miss, never a full disk) >= ``get_blocking_failed_threshold``: unhealthy, the
   window starts.
3. A probe file written, read back and removed within ``health_ping_timeout``; a disk call (a
   read, or the writer's) stuck for longer than that fails the round without one.

A full disk (ENOSPC, EDQUOT) answers at once: the check passes with a warning (``warn``, the
server healthy) while the tier's writes are stopped, and the tier goes on serving its files.

Its policy is the server's: recompute (unhealthy: every tier skipped) or local_cpu (the file
tier bypassed: no reads, no writes, L1 caching meanwhile).
"""

from __future__ import annotations

from dataplane.health.base import Components, HealthCheck
from dataplane.health.checks.remote import RemoteBackendHealthCheck


class FileTierHealthCheck(RemoteBackendHealthCheck):
    component_type = "datastore"
    failed_calls = "failed disk calls"
    ping_timed_out = "the probe file did not round-trip in time, or a disk call is stuck"
    ping_failed = "the probe file could not be written or read back (read-only or gone?)"

    @classmethod
    def create(cls, components: Components) -> list[HealthCheck]:
        return [cls(name, tier, components) for name, tier in components.fs_tiers.items()]

    def name(self) -> str:
        return f"fs_tier:{self.backend.url}"
