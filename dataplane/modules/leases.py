"""Leases: L1 buffers an engine-driven worker holds between two requests (one-copy transfers).

A reserve lease holds buffers handed out for the worker to write (invisible until committed)
and pins on the prompt's chunks already held; an acquire lease pins the chunks the worker
copies out. Leases are per-instance state: they live in the instance's entry, and whatever
releases the instance (UNREGISTER, a reap, the admin reap) aborts them, so nothing
half-written is ever published and no pin is left behind; a lease built after that (by a
request that did not hold the instance) is refused and aborted.

The worker writes into L1's memory itself, so a buffer taken from a worker that may still be
writing (it was reaped while stopped mid-copy, or its lease expired) is not handed out again
at once: it is quarantined (`L1Store.quarantine`) for ``QUARANTINE_S`` before it returns to the
allocator. A lease is open at most ``LEASE_TTL_S`` (a copy takes milliseconds: an older lease
lost its reply or its worker); at most ``MAX_LEASES`` are open per instance. ``_lock`` of
`Leases` guards its dict and counter only; L1 is called outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.tenants import NO_TENANT
from dataplane.wire.errors import LimitExceeded, NotRegistered, RequestError

MAX_LEASES = 16  # open at once per instance
_LEASE_IDS = itertools.count(1)
LEASE_TTL_S = 60.0


@dataclass
class Lease:
    keys: list[bytes] = field(default_factory=list)  # of the buffers, to commit under
    bufs: list[torch.Tensor] = field(default_factory=list)  # reserved, not yet committed
    pinned: list[bytes] = field(default_factory=list)  # to release
    opened: float = 0.0
    mark: int = 0  # its keys' mark in L1's in-flight index (`dataplane.storage.l1.inflight`)
    scope: bytes = b""  # its keys' scope (where lower tiers file them)
    words: str | None = None  # the dtype of its chunks' elements (which lower tiers may code)

    def abort(self, l1: L1Store, worker_may_write: bool = False) -> None:
        """Return the buffers (quarantined when the worker may still write into them) and
        let go of the pins."""
        for buf in self.bufs:
            if worker_may_write:
                l1.quarantine(buf)
            else:
                l1.abort(buf)
        self.bufs = []
        l1.inflight.end(self.mark)
        l1.release(self.pinned)
        self.pinned = []

    def commit(self, l1: L1Store, count: int | None = None) -> int:
        """Publish the next ``count`` buffers (all with None), in the order handed out; the
        chunks stored (a key already held is not stored again)."""
        n = len(self.bufs) if count is None else min(count, len(self.bufs))
        keys, bufs = self.keys[:n], self.bufs[:n]
        stored = sum(
            l1.commit(key, buf, scope=self.scope, words=self.words)
            for key, buf in zip(keys, bufs, strict=True)
        )
        self.keys, self.bufs = self.keys[n:], self.bufs[n:]
        l1.inflight.landed(self.mark, keys)
        return stored


def reserve_into(
    lease: Lease,
    l1: L1Store,
    keys: list[bytes],
    nbytes: int,
    tenant: bytes = NO_TENANT,
    conn_fd: int = -1,
    scope: bytes = b"",
    words: str | None = None,
) -> tuple[list[int], int, int, int]:
    """A reserve: pin the chunks of ``keys`` L1 holds and take a buffer of ``nbytes`` for each
    of the others, into ``lease``, whose keys lookups then count as being stored (over
    connection ``conn_fd``: they stop counting when it closes). Returns (the indices of ``keys``
    handed a buffer, how many were held, how many were rejected: L1 full of pinned chunks, how
    many skipped: L1 is not writable now, unhealthy)."""
    missing, held = l1.pin_present(keys)
    lease.pinned += held
    rejected = skipped = 0
    if missing and not l1.writable():  # unhealthy: nothing is handed out to write
        missing, skipped = [], len(missing)
    for n, i in enumerate(missing):
        buf = l1.reserve(nbytes, tenant)
        if buf is None:  # L1 is full of pinned chunks: the rest cannot be stored
            rejected = len(missing) - n
            break
        lease.keys.append(keys[i])
        lease.bufs.append(buf)
    lease.mark = l1.inflight.open(lease.keys, conn_fd)
    lease.scope, lease.words = scope, words
    return missing[: len(lease.bufs)], len(held), rejected, skipped


class Leases:
    """The open leases of one instance."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # guards _open and _closed
        self._open: dict[int, Lease] = {}
        self._closed = False  # the instance was released: no lease opens any more

    def room(self, l1: L1Store) -> None:
        """Before a lease is built: expire stale leases, then LimitExceeded when none more
        may open (checked before L1 is touched, so a refusal evicts and reserves nothing)."""
        now = self._clock()
        with self._lock:
            stale = [lid for lid, lease in self._open.items() if now - lease.opened > LEASE_TTL_S]
            expired = [self._open.pop(lid) for lid in stale]
            full = len(self._open) >= MAX_LEASES
        for lease in expired:
            lease.abort(l1, worker_may_write=True)
        if full:
            raise LimitExceeded(f"{MAX_LEASES} leases are open: commit or release them first", "leases")

    def add(self, lease: Lease) -> int:
        lease.opened = self._clock()
        lid = next(_LEASE_IDS)  # unique in the server: an old id never names a new lease
        with self._lock:
            if self._closed:  # (a request that only touched the instance raced its release)
                raise NotRegistered("the instance was released while this request ran")
            self._open[lid] = lease
        return lid

    def take(self, lid: int) -> Lease:
        with self._lock:
            lease = self._open.pop(lid, None)
        if lease is None:
            raise RequestError(f"lease {lid} is not open (committed, released, expired, or never given)")
        return lease

    def put_back(self, lid: int, lease: Lease, l1: L1Store) -> None:
        """A lease taken for a partial commit stays open under its id; aborted instead when the
        instance was released meanwhile (its worker may still be writing)."""
        with self._lock:
            if not self._closed:
                self._open[lid] = lease
                return
        lease.abort(l1, worker_may_write=True)
        raise NotRegistered("the instance was released while this request ran")

    def abort_all(self, l1: L1Store) -> None:
        """The instance goes: its worker may be alive and mid-copy (a reap, an admin reap)."""
        with self._lock:
            leases, self._open, self._closed = list(self._open.values()), {}, True
        for lease in leases:
            lease.abort(l1, worker_may_write=True)
