"""Budgets of what registrations take: bytes (server-owned pool segments, worker memory the
server maps; ``ByteBudget._lock`` is a leaf lock guarding ``used``) and file descriptors."""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable

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
                    f"{self.capacity} bytes ({self._used} in use; --{self.setting.replace('_', '-')})",
                    self.setting,
                )
            self._used += nbytes

    def give_back(self, nbytes: int) -> None:
        with self._lock:
            self._used = max(0, self._used - nbytes)

    @property
    def used(self) -> int:
        with self._lock:
            return self._used


class DescriptorReserve:
    """Registrations are refused while fewer than ``reserve`` file descriptors are free beyond
    ``held_back()`` (the data-plane connections its cap still allows), each mapping holding one
    and a server-owned pool two, so the server always keeps room to accept connections up to its
    cap, refuse those past it and serve its sidecar. Read from ``/proc/self/fd`` at each check."""

    def __init__(self, reserve: int = 128, held_back: Callable[[], int] | None = None) -> None:
        self.reserve = reserve
        self.held_back = held_back or (lambda: 0)

    def check(self, what: str) -> None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY:
            return
        try:
            used = len(os.listdir("/proc/self/fd"))
        except OSError:
            return  # no /proc: the kernel's EMFILE is the only bound
        conns = self.held_back()
        if soft - used < self.reserve + conns:
            raise LimitExceeded(
                f"{what}: the server holds {used} of its {soft} file descriptors and keeps "
                f"{self.reserve + conns} free ({conns} for the connections --max-connections still "
                "allows); raise its limit (ulimit -n), or lower --max-instances or --max-connections",
                "descriptors",
            )
