"""One-copy engine-driven transfers, worker side: copy straight into and out of L1's arena.

When the server's L1 arena is shared memory, ENGINE_REGISTER names it and the worker maps it.
A STORE asks for buffers (ENGINE_RESERVE: the server answers with arena offsets for the chunks
it does not hold), gathers each chunk from the worker's blocks into its buffer, and commits
(ENGINE_COMMIT). A RETRIEVE asks for the held prefix (ENGINE_ACQUIRE: offsets of pinned
chunks), scatters each into the worker's blocks, and lets go (ENGINE_RELEASE). One copy each
way; the server never touches the bytes. A copy that fails lets go of its lease at once (a
RELEASE aborts a reserve: nothing half-written is ever published). The caller serialises
transfers (`dataplane.client.transport.EngineDrivenTransport`'s lock).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from dataplane.memory.kvmemory import MappedKV, token_slots
from dataplane.wire.errors import KVWardenError, RequestAborted, RequestError
from dataplane.wire.messages import (
    MAX_POOL_CHUNKS,
    EngineAcquire,
    EngineCommit,
    EngineRelease,
    EngineReserve,
    Message,
)

Send = Callable[[Message], Any]


class ArenaCopier:
    def __init__(self, instance_id: int, secret: bytes, arena: torch.Tensor) -> None:
        self.instance_id = instance_id
        self.secret = secret
        self.arena = arena  # the server's L1 arena, as mapped here (uint8)

    def store(self, send: Send, local: MappedKV, tokens: np.ndarray, blocks: np.ndarray, cs: int
              ) -> dict[str, int]:  # fmt: skip
        n_full = len(tokens) // cs
        slots = token_slots(blocks, local.block_size, local.num_blocks, n_full * cs)
        total = {"chunks": n_full, "stored": 0, "present": 0, "rejected": 0}
        for first in range(0, n_full, MAX_POOL_CHUNKS):
            k = min(MAX_POOL_CHUNKS, n_full - first)
            r = send(EngineReserve(self.instance_id, self.secret, tokens[: (first + k) * cs], first, k))
            cb = int(r["slot_bytes"])
            with self._lease(send, int(r["lease"]), commit=True) as done:
                for idx, off in r["slots"]:
                    c = first + int(idx)
                    local.gather(slots[c * cs : (c + 1) * cs], self.arena[off : off + cb])
            total["stored"] += done["stored"]
            total["present"] += int(r["present"])
            total["rejected"] += int(r["rejected"])
            if r["rejected"]:
                total["rejected"] += n_full - first - k
                break
        return total

    def retrieve(self, send: Send, local: MappedKV, tokens: np.ndarray, blocks: np.ndarray, cs: int) -> int:
        n_full = len(tokens) // cs
        first = 0
        while first < n_full:
            k = min(MAX_POOL_CHUNKS, n_full - first)
            r = send(EngineAcquire(self.instance_id, self.secret, tokens[: (first + k) * cs], first, k))
            offsets, cb = [int(o) for o in r["offsets"]], int(r["slot_bytes"])
            with self._lease(send, int(r["lease"]), commit=False):
                slots = token_slots(blocks, local.block_size, local.num_blocks, (first + len(offsets)) * cs)
                for i, off in enumerate(offsets):
                    c = first + i
                    local.scatter(slots[c * cs : (c + 1) * cs], self.arena[off : off + cb])
            first += len(offsets)
            if len(offsets) < k:
                break
        return first * cs

    @contextlib.contextmanager
    def _lease(self, send: Send, lease: int, commit: bool) -> Iterator[dict[str, int]]:
        """Commit (a reserve) or release (an acquire) once the copies are done, the commit's
        count in the yielded dict; on a failure release at once (best effort: a server that is
        gone drops the lease with the instance)."""
        done = {"stored": 0}
        try:
            yield done
        except BaseException:
            with contextlib.suppress(KVWardenError):
                send(EngineRelease(self.instance_id, self.secret, lease))
            raise
        try:
            if commit:
                done["stored"] = int(send(EngineCommit(self.instance_id, self.secret, lease))["stored"])
            else:
                send(EngineRelease(self.instance_id, self.secret, lease))
        except RequestError as exc:  # the instance was released mid-copy (reaped, re-registered)
            # what was written is not published, and what was read may have changed under it
            raise RequestAborted(f"lease {lease} lost mid-copy: {exc}") from None
