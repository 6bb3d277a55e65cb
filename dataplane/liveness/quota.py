"""How many instances a server tracks: at most ``max_instances`` in all, and at most
``max_per_connection`` registered over any one connection, so one client cannot fill the
server's descriptors, mappings and `/status` with registrations.

One quota is shared by the registries of a server, so it is also where an id's owner is known
across transfer modes: an id registered in one mode cannot be taken in the other under another
secret. A registry asks it to ``admit`` a new id (never while holding its own lock: ``_lock``
here is a leaf lock guarding the counts and owners) and tells it to ``forget`` ids it no longer
holds. A closed connection's count is dropped: its instances stay counted in the total until
they go.
"""

from __future__ import annotations

import hmac
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from dataplane.wire.errors import LimitExceeded, NotOwner


@dataclass
class _Held:
    conn_fd: int  # the connection the instance first registered over
    secret: bytes  # its owner's
    holders: int  # registries holding it (one per transfer mode it is registered in)


class InstanceQuota:
    def __init__(self, max_instances: int, max_per_connection: int) -> None:
        self.max_instances = max_instances
        self.max_per_connection = max_per_connection
        self._lock = threading.Lock()  # guards _by_id and _per_conn
        self._by_id: dict[int, _Held] = {}
        self._per_conn: Counter[int] = Counter()

    def admit(self, instance_id: int, conn_fd: int, secret: bytes) -> None:
        """One more registry holds ``instance_id``: each successful call is undone by exactly
        one ``forget``. A new id takes a place, or LimitExceeded names the limit; an id already
        held (in the other transfer mode) takes none, and only its owner may add to it:
        NotOwner for another secret."""
        with self._lock:
            held = self._by_id.get(instance_id)
            if held is not None:
                if not hmac.compare_digest(held.secret, secret):
                    raise NotOwner(
                        f"instance {instance_id} is registered by another owner (in another "
                        "transfer mode): its requests must carry the secret it registered with"
                    )
                held.holders += 1
                return
            if len(self._by_id) >= self.max_instances:
                raise LimitExceeded(
                    f"the server tracks {len(self._by_id)} instances, its limit (max_instances "
                    f"{self.max_instances}): unregister some, or raise --max-instances",
                    "max_instances",
                )
            if conn_fd >= 0 and self._per_conn[conn_fd] >= self.max_per_connection:
                raise LimitExceeded(
                    f"{self._per_conn[conn_fd]} instances were registered over this connection, "
                    f"its limit (max_instances_per_connection {self.max_per_connection})",
                    "max_instances_per_connection",
                )
            self._by_id[instance_id] = _Held(conn_fd, secret, 1)
            if conn_fd >= 0:
                self._per_conn[conn_fd] += 1

    def forget(self, instance_ids: Iterable[int]) -> None:
        """A registry no longer holds these ids; an id no registry holds gives its place back."""
        with self._lock:
            for iid in instance_ids:
                held = self._by_id.get(iid)
                if held is None:
                    continue
                held.holders -= 1
                if held.holders > 0:
                    continue
                del self._by_id[iid]
                fd = held.conn_fd
                if fd >= 0 and self._per_conn.get(fd, 0) > 0:
                    self._per_conn[fd] -= 1
                    if not self._per_conn[fd]:
                        del self._per_conn[fd]

    def on_connection(self, conn_fd: int, connected: bool) -> None:
        """A closed connection's count is dropped: a new connection reusing the number starts
        from zero. (Constant time: it runs on the loop. An instance of the closed connection that
        goes later may take one off the new one's count, never below zero.)"""
        if not connected:
            with self._lock:
                self._per_conn.pop(conn_fd, None)

    @property
    def tracked(self) -> int:
        with self._lock:
            return len(self._by_id)
