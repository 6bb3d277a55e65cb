"""TieredStore: L1 first, then the remote tier, behind the health gate; what the modules use.

A subclass of the L1 store (`L1Store`): the modules call it through L1's interface, and it adds:

- **LOOKUP** (`prefix_hits`): the prefix L1 holds, then how far the remote tier continues it, in
  one pipelined round trip.
- **RETRIEVE** (`acquire_prefix`): what L1 lacks is read from the remote tier, checked, and
  promoted into L1 (pinned like the rest), chunk by chunk until the first miss.
- **STORE** (`commit`): a chunk newly committed to L1 is queued for the remote tier (write-behind,
  never waited for), its L1 buffer pinned until the write is done. With the hot cache off
  (``local_cpu=false``) L1 only stages: a chunk leaves L1 once written and no reader holds it.
- **The health gate** (``gate``, the health monitor's ``is_healthy``): while it says no,
  STORE is skipped (`writable`), RETRIEVE is an all-miss and LOOKUP is 0, each with a warning
  at most every `WARN_EVERY_S` (the count of what was skipped meanwhile in it).

Remote reads run on the caller's thread (transfer and normal workers), each bounded by the
backend's timeout, and never on the loop thread: what it may call (`acquire_local`, `commit`,
which only queues the write, `release`, `pin_present`, `reserve`) never calls Redis. A one-copy
ACQUIRE answered on the loop takes L1's part of the prefix with `acquire_local`, and is handed to
the transfer pool when the remote tier might continue it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from dataplane.storage.arena import Arena
from dataplane.storage.l1 import L1Store
from dataplane.storage.remote import RemoteBackend
from dataplane.storage.tenants import NO_TENANT

logger = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
_DTYPE = "uint8"  # chunks are bytes; the key binds the layout (dataplane.storage.keys)


class TieredStore(L1Store):
    def __init__(
        self,
        capacity_bytes: int,
        hot_cache: bool = True,
        arena: Arena | None = None,
        clock: Callable[[], float] = time.monotonic,
        remote: RemoteBackend | None = None,
        gate: Callable[[], bool] | None = None,
        tenant_share_bytes: int | None = None,
    ) -> None:
        super().__init__(capacity_bytes, hot_cache, arena, clock, tenant_share_bytes)
        self.remote = remote
        self.gate = gate or (lambda: True)
        self._warn_lock = threading.Lock()  # leaf: guards _warned_at and _suppressed
        self._warned_at: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self.promoted = 0  # chunks read from the remote tier into L1

    # ------------------------------------------------------------------ gate
    def writable(self) -> bool:
        return self._open("STORE", "skipped")

    def _open(self, what: str, answer: str) -> bool:
        if self.gate():
            return True
        self._warn(what, answer)
        return False

    def _warn(self, what: str, answer: str) -> None:
        now = self._clock()
        with self._warn_lock:
            last = self._warned_at.get(what)
            if last is not None and now - last < WARN_EVERY_S:
                self._suppressed[what] = self._suppressed.get(what, 0) + 1
                return
            self._warned_at[what] = now
            n = self._suppressed.pop(what, 0)
        more = f" ({n} more since the last warning)" if n else ""
        logger.warning("storage: unhealthy (recompute): %s %s%s", what, answer, more)

    # ----------------------------------------------------------------- reads
    def prefix_hits(self, keys: list[bytes]) -> int:
        if not self._open("LOOKUP", "answered 0"):
            return 0
        n = super().prefix_hits(keys)
        if self.remote is not None and n < len(keys):
            n += self.remote.count_prefix(keys[n:])
        return n

    def acquire_prefix(self, keys: list[bytes], tenant: bytes = NO_TENANT) -> list[torch.Tensor]:
        if not self._open("RETRIEVE", "answered with misses"):
            return []
        bufs = super().acquire_prefix(keys)
        if self.remote is None or len(bufs) == len(keys):
            return bufs
        nbytes = bufs[0].numel() if bufs else None
        for key in keys[len(bufs) :]:
            buf = self._promote(key, nbytes, tenant)
            if buf is None:
                break
            nbytes = buf.numel()
            bufs.append(buf)
        return bufs

    def acquire_local(self, keys: list[bytes]) -> list[torch.Tensor] | None:
        """`acquire_prefix` for a caller that must not wait (the loop thread): what L1 holds of
        the prefix, pinned, when the remote tier could not add to it; None (nothing pinned) when
        it might: the caller asks `acquire_prefix` where waiting is fine. Never calls Redis."""
        if not self._open("RETRIEVE", "answered with misses"):
            return []
        bufs = super().acquire_prefix(keys)
        if self.remote is None or len(bufs) == len(keys):
            return bufs
        super().release(keys[: len(bufs)])  # (L1's own release: they stay as they were)
        return None

    def _promote(self, key: bytes, nbytes: int | None, tenant: bytes) -> torch.Tensor | None:
        """The chunk of ``key`` from the remote tier, copied into L1 and pinned; None: not there
        (or damaged, or of another size, or L1 has no room)."""
        assert self.remote is not None
        payload = self.remote.get(key, _DTYPE, None if nbytes is None else (nbytes,))
        if payload is None:
            return None
        buf = self.reserve(payload.nbytes, tenant)
        if buf is None:
            return None
        try:
            buf.numpy()[:] = np.frombuffer(payload, np.uint8)
        except BaseException:
            self.abort(buf)
            raise
        super().commit(key, buf)  # not commit(): it came from the remote tier
        got = super().acquire_prefix([key])  # pinned (whichever copy won a race)
        if got:
            self.promoted += 1
        return got[0] if got else None

    # ---------------------------------------------------------------- writes
    def commit(self, key: bytes, buf: torch.Tensor, pin: bool = False) -> bool:
        written = super().commit(key, buf, pin)
        if written and self.remote is not None:
            self.pin_present([key])  # until the write-behind queue is done with its bytes
            view = memoryview(buf.numpy().data)
            self.remote.put(key, _DTYPE, (buf.numel(),), view, lambda: self._written(key))
        return written

    def _written(self, key: bytes) -> None:
        """The remote write of ``key`` is done (sent, failed or dropped)."""
        self.release([key])
        if not self.hot_cache:
            self.discard([key])

    def release(self, keys: list[bytes]) -> None:
        super().release(keys)
        if not self.hot_cache and self.remote is not None:
            self.discard(keys)  # staging only: what no reader holds leaves L1
