"""One tracked instance: its entry (mutable, guarded by its registry's lock), the read-only
copy the sidecar sees (`ContextEntry`), and the small rules every registry applies to an entry
(who owns it, what a request over a connection changes). Nothing here takes a lock: callers
hold their registry's."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import NamedTuple

from dataplane.wire.errors import NotOwner


@dataclass(frozen=True)
class InstanceInfo:
    """What a worker registered, as operators see it."""

    transfer_mode: str
    memory: str
    model_name: str
    world_size: int
    worker_id: int
    owner_pid: int
    num_layers: int
    dtype: str


class ContextEntry(NamedTuple):
    """A read-only copy of an entry's public fields (what the sidecar sees). A tuple: the
    sidecar copies 10,000 of these per /status, and a frozen dataclass costs 4x to build."""

    instance_id: int
    transfer_mode: str
    memory: str
    model_name: str
    world_size: int
    worker_id: int
    owner_pid: int
    num_layers: int
    dtype: str
    registered_at: float
    last_seen: float
    has_liveness_signal: bool
    disconnected: bool
    conn_fd: int


@dataclass(eq=False)
class Entry:
    instance_id: int
    registered_at: float
    last_seen: float
    scope: bytes  # chunk-key scope of the registered layout (see dataplane.storage.keys)
    info: InstanceInfo
    has_liveness_signal: bool = False
    conn_fd: int = -1
    disconnected_at: float | None = None
    secret: bytes = b""  # what every request of this instance carries (its registrant's)
    users: int = 0  # requests holding the entry's resources
    removed: bool = False  # popped; the last user releases


def owned_by(e: Entry, secret: bytes | None) -> bool:
    """``secret`` None: an in-process caller that is no request (no check)."""
    return secret is None or hmac.compare_digest(e.secret, secret)


def own(e: Entry, secret: bytes | None) -> None:
    if not owned_by(e, secret):
        raise NotOwner(
            f"instance {e.instance_id} is registered by another owner: its requests must carry "
            "the secret it registered with"
        )


def mark_removed(e: Entry) -> bool:
    """Flag a popped entry; True when no request holds it (so the caller releases it now)."""
    e.removed = True
    return e.users == 0


def seen_over(e: Entry, conn_fd: int) -> None:
    if conn_fd >= 0:
        e.conn_fd = conn_fd
        e.disconnected_at = None  # it spoke: its connection is (again) alive


def from_row(
    iid: int,
    i: InstanceInfo,
    registered_at: float,
    last_seen: float,
    signal: bool,
    disconnected: bool,
    conn_fd: int,
) -> ContextEntry:
    return ContextEntry(
        iid,
        i.transfer_mode,
        i.memory,
        i.model_name,
        i.world_size,
        i.worker_id,
        i.owner_pid,
        i.num_layers,
        i.dtype,
        registered_at,
        last_seen,
        signal,
        disconnected,
        conn_fd,
    )


Row = tuple[int, InstanceInfo, float, float, bool, bool, int]


def row(e: Entry) -> Row:
    """The public fields of an entry as a plain tuple (cheap to copy under the lock)."""
    return (
        e.instance_id,
        e.info,
        e.registered_at,
        e.last_seen,
        e.has_liveness_signal,
        e.disconnected_at is not None,
        e.conn_fd,
    )


# what changes of a tracked instance while it lives: (instance_id, registered_at, last_seen,
# has_liveness_signal, disconnected); the rest of ContextEntry is fixed at registration
LivenessRow = tuple[int, float, float, bool, bool]


def public(e: Entry) -> ContextEntry:
    return from_row(*row(e))
