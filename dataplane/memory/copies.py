"""Where a chunk's tokens live in a worker's blocks, and the threads a big copy is split across.

`token_slots` maps a chunk's tokens to slots (block * block_size + offset); a copy moves them as
runs of consecutive slots (`slot_runs`) or, when they are whole blocks (`whole_blocks`, what a
chunk always is when its size is a multiple of the block size), block by block. `ChunkMap` gives
each chunk of a request its `Placement`: whole `Blocks` straight from the block ids when chunks
are whole blocks, so a copy skips the per-token slots.
`CopySplitter` splits one copy across threads by layers; `spawn_all` starts a pool's threads at
once instead of at the first request.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# Above this many runs per chunk a single index op beats one copy per run.
_MAX_RUNS = 32


def _needed_blocks(
    block_ids: np.ndarray,
    block_size: int,
    num_blocks: int,
    n_tokens: int,
    from_block: int = 0,
    holes: bool = False,
) -> np.ndarray:
    """The blocks holding the first ``n_tokens`` tokens (int64); ValueError names a bad or
    missing block. Those before ``from_block`` are not checked (and read as -1); ``holes``:
    -1 passes, a block not to write (`ChunkMap`)."""
    need = -(-n_tokens // block_size)
    if len(block_ids) < need:
        raise ValueError(
            f"block_ids: {len(block_ids)} blocks cannot hold {n_tokens} tokens "
            f"(block size {block_size} needs {need})"
        )
    blocks = np.asarray(block_ids[:need], dtype=np.int64).copy()
    blocks[: min(from_block, need)] = -1
    checked = blocks[from_block:]
    low = -1 if holes else 0
    if len(checked) and (checked.min() < low or checked.max() >= num_blocks):
        i = from_block + int(np.flatnonzero((checked < low) | (checked >= num_blocks))[0])
        raise ValueError(
            f"block_ids[{i}]: block {int(blocks[i])} is outside the registered cache [0, {num_blocks})"
        )
    return blocks


def token_slots(block_ids: np.ndarray, block_size: int, num_blocks: int, n_tokens: int) -> np.ndarray:
    """Slot (block * block_size + offset) of each of the first ``n_tokens`` tokens, where token
    i lives in block ``block_ids[i // block_size]``. ValueError names a bad or missing block."""
    return Blocks(_needed_blocks(block_ids, block_size, num_blocks, n_tokens), block_size).slots()[:n_tokens]


@dataclass(frozen=True, slots=True)
class Blocks:
    """Whole blocks, each block's tokens in order: where a chunk lives when its size is a
    multiple of the block size. A copy moves them block by block without working out, and
    checking, every token's slot."""

    ids: np.ndarray  # int64, validated against the cache
    block_size: int

    def slots(self) -> np.ndarray:
        offsets = np.arange(self.block_size, dtype=np.int64)
        return np.asarray((self.ids[:, None] * self.block_size + offsets).reshape(-1))


# where a chunk's tokens live: one slot per token, or whole blocks
Placement = np.ndarray | Blocks


class ChunkMap:
    """Where each of ``n_chunks`` chunks of ``chunk_size`` tokens lives in a worker's blocks,
    token i in block ``block_ids[i // block_size]``; ValueError (at construction) names a bad or
    missing block. ``map[i]`` is chunk i's `Placement`: whole `Blocks` when the chunk size is a
    multiple of the block size, else token slots. From chunk ``first`` on (whole blocks only:
    the blocks before it are not the prompt's, a sliding window's freed blocks); ``holes``: a
    block id of -1 is a block not to write (vLLM's null block in a sliding window), which only
    a block-major copy into the worker's memory skips (`BlockKV.scatter`)."""

    def __init__(
        self,
        block_ids: np.ndarray,
        block_size: int,
        num_blocks: int,
        n_chunks: int,
        chunk_size: int,
        first: int = 0,
        holes: bool = False,
    ) -> None:
        self.chunk_size = chunk_size
        n_tokens = n_chunks * chunk_size
        self._blocks: np.ndarray | None = None
        self._slots: np.ndarray | None = None
        self._block_size = block_size
        if chunk_size % block_size == 0:
            from_block = first * chunk_size // block_size
            self._blocks = _needed_blocks(block_ids, block_size, num_blocks, n_tokens, from_block, holes)
        elif first:
            raise ValueError(
                f"chunks from chunk {first} on move as whole blocks: chunk size {chunk_size} is not "
                f"a multiple of the block size {block_size}"
            )
        else:
            self._slots = token_slots(block_ids, block_size, num_blocks, n_tokens)

    def __getitem__(self, i: int) -> Placement:
        cs = self.chunk_size
        if self._blocks is not None:
            per = cs // self._block_size
            return Blocks(self._blocks[i * per : (i + 1) * per], self._block_size)
        assert self._slots is not None
        return self._slots[i * cs : (i + 1) * cs]


def slot_runs(slots: np.ndarray, dst: np.ndarray | None = None) -> list[tuple[int, int, int]]:
    """(dst_start, src_start, length) runs over which the source ``slots`` and their
    destinations (``dst``; by default 0, 1, 2, ...) both advance by one."""
    if len(slots) == 0:
        return []
    step = np.diff(slots) != 1
    if dst is not None:
        step |= np.diff(dst) != 1
    breaks = np.flatnonzero(step) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(slots)]))
    first = starts if dst is None else dst[starts]
    return [(int(d), int(slots[s]), int(e - s)) for d, s, e in zip(first, starts, ends, strict=True)]


def whole_blocks(slots: np.ndarray, block_size: int) -> np.ndarray | None:
    """The blocks ``slots`` covers when it is whole blocks, each block's slots in order (what a
    chunk of whole blocks always is), else None: then a copy moves whole blocks, one indexed copy
    per layer instead of one per run of slots."""
    n = len(slots)
    if n == 0 or n % block_size:
        return None
    rows = slots.reshape(-1, block_size)
    first = rows[:, 0]
    if np.any(first % block_size) or np.any(rows - first[:, None] != np.arange(block_size)):
        return None
    return np.asarray(first // block_size, dtype=np.int64)


def spawn_all(pool: ThreadPoolExecutor, workers: int) -> None:
    """Start every thread of ``pool`` now. A pool spawns lazily, at a request; creating a thread
    maps its stack, which waits for the address-space lock while the L1 arena is being faulted
    in: the first transfer of a fresh server waited 200 ms for it."""
    barrier = threading.Barrier(workers + 1)
    for _ in range(workers):
        pool.submit(barrier.wait, 10.0)
    barrier.wait(10.0)


def server_copy_ways() -> int:
    """How many threads the server splits a chunk copy across: one per core, at most 4."""
    return min(os.cpu_count() or 1, 4)


class CopySplitter:
    """Splits one big copy across ``ways`` threads by ranges of an outer dimension (layers).

    The calling thread takes the last range; the others run on this object's helper threads.
    Each torch copy runs single-threaded: threads that wait on events, unlike OpenMP teams
    spinning at a barrier, lose nothing when a core is briefly taken by another process.
    """

    def __init__(self, ways: int) -> None:
        self.ways = max(1, ways)
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        if self.ways > 1 and self._pool is None:
            self._pool = ThreadPoolExecutor(self.ways - 1, thread_name_prefix="kvwarden-copy")
            spawn_all(self._pool, self.ways - 1)

    def stop(self) -> None:
        """Stop and join the helper threads (copies already submitted finish first)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def run(self, fn: Callable[[int, int], None], n: int) -> None:
        pool = self._pool
        ways = min(self.ways, n) if pool is not None else 1
        if ways <= 1:
            fn(0, n)
            return
        bounds = [n * k // ways for k in range(ways + 1)]
        futures = [pool.submit(fn, bounds[k], bounds[k + 1]) for k in range(ways - 1)]  # type: ignore[union-attr]
        try:
            fn(bounds[-2], bounds[-1])
        finally:
            for f in futures:
                f.result()
