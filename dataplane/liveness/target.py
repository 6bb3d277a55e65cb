"""The liveness protocol every target speaks, and the record of one reap.

A *liveness target* is anything holding per-instance state on the server. Every method is a
no-op by default; each implementer overrides its role. Transfer modules' registries
(`dataplane.liveness.registry.LivenessRegistry`) implement the tracking methods; a module that
keeps only per-instance side state (blend) overrides ``drop_instance_state`` alone. Beyond the
reference protocol, registries also track the connection each instance last spoke over
(``mark_connection_closed``, ``reap_disconnected_instances``), and a reap returns `Reaped`
records (id, reason, silence) rather than bare ids, so the one release path
(`dataplane.liveness.release.InstanceReleaser`) can count reaps by reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

# why an instance was reaped (the label of kvwarden_instances_reaped_total)
REAP_REASONS = ("timeout", "grace", "disconnect", "admin")


class Reaped(NamedTuple):
    """One instance a reap collected and popped (its resources already being released)."""

    instance_id: int
    reason: str  # one of REAP_REASONS
    silence_s: float  # since it was last seen
    pinged: bool  # whether it ever sent a PING


class InstanceLivenessTarget:
    """The liveness protocol; every method is a no-op until a target overrides its role."""

    name = "target"

    def touch_instance(self, instance_id: int, conn_fd: int = -1, secret: bytes | None = None) -> bool:
        """Refresh ``last_seen`` and latch ``has_liveness_signal``; never inserts.

        Returns whether the id is tracked here (and ``secret``, when given, is its owner's)."""
        return False

    def reap_stale_instances(self, timeout_s: float, grace_s: float) -> list[Reaped]:
        """Collect and pop the instances silent past their window; release them."""
        return []

    def reap_disconnected_instances(self, disconnect_grace_s: float) -> list[Reaped]:
        """Collect and pop the instances whose connection closed over the grace ago."""
        return []

    def mark_connection_closed(self, conn_fd: int, now: float) -> int:
        """Flag the instances last seen over ``conn_fd``; returns how many."""
        return 0

    def tracked_instance_count(self) -> int:
        return 0

    def remove_instances(self, instance_ids: Iterable[int], why: str) -> list[int]:
        """Release these instances through the UNREGISTER cleanup; the ids that were held."""
        return []

    def check_owner(self, instance_id: int, secret: bytes) -> None:
        """Raise NotOwner when ``instance_id`` is held here under another secret."""
        return None

    def drop_instance_state(self, instance_id: int) -> None:
        """Forget any per-instance side state of ``instance_id`` (unknown ids: a no-op)."""
        return None
