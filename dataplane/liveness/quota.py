"""How many instances a server tracks: at most ``max_instances`` in all, and at most
``max_per_connection`` registered over any one connection, so one client cannot fill the
server's descriptors, mappings and `/status` with registrations.

One quota is shared by the registries of a server. A registry asks it to ``admit`` a new id
(never while holding its own lock: ``_lock`` here is a leaf lock guarding the two counts) and
tells it to ``forget`` ids it no longer holds. A closed connection's count is dropped: its
instances stay counted in the total until they go.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from dataplane.wire.errors import LimitExceeded


class InstanceQuota:
    def __init__(self, max_instances: int, max_per_connection: int) -> None:
        self.max_instances = max_instances
        self.max_per_connection = max_per_connection
        self._lock = threading.Lock()  # guards _by_id and _per_conn
        self._by_id: dict[int, int] = {}  # instance id -> the connection it registered over
        self._per_conn: Counter[int] = Counter()

    def admit(self, instance_id: int, conn_fd: int) -> None:
        """Count a new instance, or raise LimitExceeded naming the limit (an id already counted,
        registered in the other transfer mode too, takes no second place)."""
        with self._lock:
            if instance_id in self._by_id:
                return
            if len(self._by_id) >= self.max_instances:
                raise LimitExceeded(
                    f"the server tracks {len(self._by_id)} instances, its limit (max_instances "
                    f"{self.max_instances}): unregister some, or raise --max-instances"
                )
            if conn_fd >= 0 and self._per_conn[conn_fd] >= self.max_per_connection:
                raise LimitExceeded(
                    f"{self._per_conn[conn_fd]} instances were registered over this connection, "
                    f"its limit (max_instances_per_connection {self.max_per_connection})"
                )
            self._by_id[instance_id] = conn_fd
            if conn_fd >= 0:
                self._per_conn[conn_fd] += 1

    def forget(self, instance_ids: Iterable[int]) -> None:
        with self._lock:
            for iid in instance_ids:
                fd = self._by_id.pop(iid, None)
                if fd is not None and self._per_conn.get(fd, 0) > 0:
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
