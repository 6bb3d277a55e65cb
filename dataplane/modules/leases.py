"""Leases: L1 buffers an engine-driven worker holds between two requests (one-copy transfers).

A reserve lease holds buffers handed out for the worker to write (invisible until committed)
and pins on the prompt's chunks already held; an acquire lease pins the chunks the worker
copies out. Leases are per-instance state: they live in the instance's entry, and whatever
releases the instance (UNREGISTER, a reap, the admin reap) aborts them, so a worker that dies
in between never leaves a half-written chunk visible nor a buffer or pin behind. ``_lock`` of
`Leases` guards its dict and counter only; L1 is called outside it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from dataplane.storage.l1 import L1Store
from dataplane.wire.errors import LimitExceeded, RequestError

MAX_LEASES = 16  # open at once per instance


@dataclass
class Lease:
    keys: list[bytes] = field(default_factory=list)  # of the buffers, to commit under
    bufs: list[torch.Tensor] = field(default_factory=list)  # reserved, not yet committed
    pinned: list[bytes] = field(default_factory=list)  # to release

    def abort(self, l1: L1Store) -> None:
        for buf in self.bufs:
            l1.abort(buf)
        self.bufs = []
        l1.release(self.pinned)
        self.pinned = []


class Leases:
    """The open leases of one instance."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _open and _next
        self._open: dict[int, Lease] = {}
        self._next = 1

    def add(self, lease: Lease) -> int:
        with self._lock:
            if len(self._open) >= MAX_LEASES:
                raise LimitExceeded(
                    f"{len(self._open)} leases are open: commit or release them first", "leases"
                )
            lid = self._next
            self._next += 1
            self._open[lid] = lease
            return lid

    def take(self, lid: int) -> Lease:
        with self._lock:
            lease = self._open.pop(lid, None)
        if lease is None:
            raise RequestError(f"lease {lid} is not open (committed, released, or never given)")
        return lease

    def abort_all(self, l1: L1Store) -> None:
        with self._lock:
            leases, self._open = list(self._open.values()), {}
        for lease in leases:
            lease.abort(l1)
