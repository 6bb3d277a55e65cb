"""What the two transfer modules share: their wiring, their registry, and writing chunks into L1.

Each transfer module owns a `LivenessRegistry` of its instances (``self.registry``, the liveness
target the reaper and the release path see) and gives it ``_release`` to free an instance's
resources.

A STORE pins the prompt's own chunks in L1 until it replies, so a prompt longer than L1 never
evicts its own prefix (which would make every chunk after it unreachable); chunks L1 cannot
take are counted as rejected, never reported stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from dataplane.liveness.entry import Entry
from dataplane.liveness.quota import InstanceQuota
from dataplane.liveness.registry import Clock, LivenessRegistry
from dataplane.memory.budget import DescriptorReserve
from dataplane.memory.copies import CopySplitter
from dataplane.metrics import DataPlaneMetrics
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.tenants import NO_TENANT
from dataplane.wire.replies import StoreCounts

logger = logging.getLogger(__name__)

E = TypeVar("E", bound=Entry)


class TransferModule(Generic[E]):
    name = "transfer"

    def __init__(
        self,
        l1: L1Store,
        chunk_size: int,
        metrics: DataPlaneMetrics,
        clock: Clock = time.monotonic,
        release_timeout_s: float = 10.0,
        splitter: CopySplitter | None = None,
        quota: InstanceQuota | None = None,
        descriptors: DescriptorReserve | None = None,
    ) -> None:
        self.registry: LivenessRegistry[E] = LivenessRegistry(
            self.name, self._release, clock, release_timeout_s, quota
        )
        self._clock = clock
        self.descriptors = descriptors  # registrations keep descriptors free for connections
        self.l1 = l1
        self.chunk_size = chunk_size
        self.metrics = metrics
        self.splitter = splitter

    @staticmethod
    def order_key(payload: Any) -> int:
        """Transfers of one instance run in arrival order."""
        return int(payload.instance_id)

    def _release(self, entry: E, why: str) -> None:
        """Free an instance's resources (runs outside the registry lock, bounded)."""

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        """Release every instance (the loop and the reaper have stopped)."""
        self.registry.close()

    def write_chunks(
        self,
        instance_id: int,
        keys: list[bytes],
        nbytes: int,
        fill: Callable[[int, torch.Tensor], None],
        prefix: list[bytes] | None = None,
        tenant: bytes = NO_TENANT,
        conn_fd: int = -1,
        scope: bytes = b"",
        words: str | None = None,
    ) -> StoreCounts:
        """Store ``keys[i]`` for every missing i, ``fill(i, buf)`` writing its bytes, as
        ``tenant``'s chunks (`dataplane.storage.l1.tenants`).

        ``prefix``: keys before these (already stored) that must not be evicted meanwhile.
        Lookups see the missing chunks as being stored until each is committed (or, should
        the request's connection ``conn_fd`` close first, not at all).
        Returns the STORE reply counts: chunks, stored, present, rejected, skipped (all of
        them while the server is unhealthy: nothing is written)."""
        if not self.l1.writable():
            return StoreCounts(len(keys), 0, 0, 0, skipped=len(keys))
        _, pinned = self.l1.pin_present(prefix or [])
        missing, held = self.l1.pin_present(keys)
        pinned += held
        stored = rejected = 0
        mark = self.l1.inflight.open([keys[i] for i in missing], conn_fd)
        try:
            for n, i in enumerate(missing):
                buf = self.l1.reserve(nbytes, tenant)
                if buf is None:  # L1 is full of pinned chunks: the rest cannot be stored
                    rejected = len(missing) - n
                    break
                try:
                    fill(i, buf)
                except BaseException:
                    self.l1.abort(buf)
                    raise
                stored += self.l1.commit(keys[i], buf, scope=scope, words=words)
                self.l1.inflight.landed(mark, [keys[i]])
                # pinned as it landed (whichever copy won): none, when a clear of the scope
                # refused it (`L1Store.commit`), so the release below lets go only of our pins
                pinned += self.l1.pin_present([keys[i]])[1]
        finally:
            self.l1.inflight.end(mark)
            self.l1.release(pinned)
        if rejected:
            self.metrics.rejected_chunks.inc(rejected)
            logger.warning(
                "transfer: STORE of instance %d: L1 full, %d chunk(s) not stored", instance_id, rejected
            )
        self.metrics.transfer_bytes.labels(direction="store").inc(stored * nbytes)
        return StoreCounts(len(keys), stored, len(keys) - len(missing), rejected, skipped=0)
