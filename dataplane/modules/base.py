"""What a module gives the server: its handlers, its lifecycle, and its liveness role."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dataplane.protocol import MsgType


class HandlerKind(enum.Enum):
    LOOP = "loop"  # cheap and non-blocking: runs on the socket loop itself
    NORMAL = "normal"  # control and metadata: the NORMAL pool
    TRANSFER = "transfer"  # STORE / RETRIEVE copies: the transfer pool, ordered per instance


@dataclass(frozen=True, slots=True)
class RequestContext:
    request_id: int
    type: MsgType
    conn_fd: int  # the TCP/IPC connection the request came over (-1 unknown)


HandlerFn = Callable[[RequestContext, Any], Any]


@dataclass(frozen=True, slots=True)
class Handler:
    kind: HandlerKind
    fn: HandlerFn
    # TRANSFER handlers: requests with the same key run in arrival order
    order_key: Callable[[Any], int] | None = None


ReapListener = Callable[[int, str, float, bool], None]  # (id, reason, silence_s, pinged)


class InstanceLivenessTarget:
    """The liveness protocol; every method is a no-op until a module overrides its role.

    Transfer modules implement the first three; modules holding per-instance side state (blend)
    implement only ``drop_instance_state``. Beyond the reference protocol, transfer modules
    also track the connection each instance last spoke over (``mark_connection_closed``,
    ``reap_disconnected_instances``) and report each reaped id with its reason to
    ``reap_listener`` (set by the management module).
    """

    reap_listener: ReapListener | None = None

    def touch_instance(self, instance_id: int, conn_fd: int = -1) -> bool:
        """Refresh ``last_seen`` and latch ``has_liveness_signal``; never inserts.

        Returns whether the id is tracked here."""
        return False

    def reap_stale_instances(self, timeout_s: float, grace_s: float) -> list[int]:
        return []

    def tracked_instance_count(self) -> int:
        return 0

    def drop_instance_state(self, instance_id: int) -> None:
        return None

    def remove_instance(self, instance_id: int, why: str) -> bool:
        """Release the instance's state through the UNREGISTER cleanup; False when unknown."""
        return False

    def mark_connection_closed(self, conn_fd: int, now: float) -> int:
        """Flag the instances last seen over ``conn_fd``; returns how many."""
        return 0

    def reap_disconnected_instances(self, disconnect_grace_s: float) -> list[int]:
        return []


class Module(Protocol):
    name: str

    def handlers(self) -> dict[MsgType, Handler]: ...

    def start(self) -> None: ...

    def stop(self) -> None:
        """Stop and join background threads (the server still serves)."""

    def close(self) -> None:
        """Release all state; called after the loop and every background thread stopped."""

    def report_status(self) -> dict[str, Any]: ...
