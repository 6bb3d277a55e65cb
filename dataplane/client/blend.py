"""The worker's side of one-copy blend transfers: it rotates the keys while it copies.

An engine-driven worker whose server shares L1's arena copies blend chunks itself, between its
blocks and L1 buffers (`dataplane.client.one_copy.ArenaCopier`), so the keys are rotated where
that copy runs: here. `WorkerRope` holds the worker's cos/sin tables (built from the RoPE
parameters it registered, once) and the compiled kernels (`dataplane.memory.rope_kernel`,
compiled on thread ``kvwarden-rope-jit`` of this process; torch until they are ready).
"""

from __future__ import annotations

import numpy as np
import torch

from dataplane.memory.blendcopy import Geometry, cache_side, chunk_side, move
from dataplane.memory.copies import CopySplitter
from dataplane.memory.kvmemory import MappedKV
from dataplane.memory.rope import RopeParams, RopeTables
from dataplane.memory.rope_kernel import KernelWarmup


class WorkerRope:
    def __init__(self, params: RopeParams) -> None:
        self.params = params
        self.kernels = KernelWarmup()
        self.kernels.start()
        self._tables: RopeTables | None = None  # built at the first one-copy blend transfer

    def _setup(self, local: MappedKV, chunk_size: int) -> tuple[RopeTables, Geometry]:
        if self._tables is None:
            self._tables = RopeTables(self.params.check(local.head_dim))
        g = Geometry(local.dtype, local.num_layers, chunk_size, local.heads, local.head_dim)
        return self._tables, g

    def into_chunk(
        self, local: MappedKV, slots: np.ndarray, buf: torch.Tensor, at: int, cs: int, splitter: CopySplitter
    ) -> None:
        """A chunk at position ``at`` in the worker's blocks to ``buf``, keys as if at 0."""
        tables, g = self._setup(local, cs)
        src, dst = cache_side(local, slots), chunk_side(buf, g)
        move(
            tables, src, dst, -at, g, splitter, self.kernels.ready, lambda w: local.gather(slots, w, splitter)
        )

    def out_of_chunk(
        self, buf: torch.Tensor, local: MappedKV, slots: np.ndarray, at: int, cs: int, splitter: CopySplitter
    ) -> None:
        """A stored chunk (keys at 0) in ``buf`` to the worker's blocks, keys rotated to ``at``."""
        tables, g = self._setup(local, cs)
        src, dst = chunk_side(buf, g), cache_side(local, slots)
        move(
            tables,
            src,
            dst,
            at,
            g,
            splitter,
            self.kernels.ready,
            lambda w: w.copy_(buf),
            lambda w: local.scatter(slots, w, splitter),
        )

    def close(self) -> None:
        self.kernels.stop()
        self.kernels.join(10.0)
