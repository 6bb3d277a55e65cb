"""A byte budget: how much of a resource (server-owned pool segments, worker memory the server
maps) may be in use at once. ``_lock`` is a leaf lock guarding ``used``."""

from __future__ import annotations

import threading

from dataplane.wire.errors import LimitExceeded


class ByteBudget:
    def __init__(self, name: str, capacity: int, setting: str) -> None:
        self.name = name
        self.capacity = capacity
        self.setting = setting  # what an operator raises (named in the refusal)
        self._lock = threading.Lock()  # guards _used
        self._used = 0

    def take(self, nbytes: int, what: str) -> None:
        """Reserve ``nbytes`` for ``what``, or raise LimitExceeded naming the budget."""
        with self._lock:
            if self._used + nbytes > self.capacity:
                raise LimitExceeded(
                    f"{what}: {nbytes} bytes would take {self.name} past its budget of "
                    f"{self.capacity} bytes ({self._used} in use; --{self.setting.replace('_', '-')})"
                )
            self._used += nbytes

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self._used = max(0, self._used - nbytes)

    @property
    def used(self) -> int:
        with self._lock:
            return self._used
