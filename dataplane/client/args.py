"""Checks of `dataplane.client.adapter.WorkerAdapter`'s arguments (ValueError naming the one
that is wrong)."""

from __future__ import annotations

import logging

from dataplane.wire.messages import KV_CODECS, MAX_POOL_CHUNKS, TransferMode
from dataplane.wire.protocol import REAP_TIMEOUT_FLOOR_S

logger = logging.getLogger("dataplane.client.adapter")
MAX_COPY_THREADS = 64


def check_args(
    transfer_mode: str, pool_chunks: int, heartbeat_interval: float, world_size: int, worker_id: int
) -> None:
    modes = [m.value for m in TransferMode]
    if transfer_mode not in modes:
        raise ValueError(f"transfer_mode {transfer_mode!r}: use {' or '.join(map(repr, modes))}")
    if not 1 <= pool_chunks <= MAX_POOL_CHUNKS:
        raise ValueError(f"pool_chunks must be in [1, {MAX_POOL_CHUNKS}]")
    if not heartbeat_interval > 0:
        raise ValueError("heartbeat_interval must be > 0")
    if not 0 <= worker_id < world_size:
        raise ValueError(f"worker_id {worker_id} must be in [0, world_size {world_size})")
    if 3 * heartbeat_interval > REAP_TIMEOUT_FLOOR_S:
        logger.warning(
            "kvwarden client: 3 x heartbeat_interval (%gs) exceeds the server's %gs reap floor: "
            "a server at the floor may reap this live worker",
            3 * heartbeat_interval,
            REAP_TIMEOUT_FLOOR_S,
        )


def check_copy_threads(transfer_mode: str, copy_threads: int | None) -> int:
    """Threads an engine-driven worker splits its copies across (1 unless given: each copy then
    runs on torch's own threads, as many as the engine set); a server-driven worker copies
    nothing itself, so it takes none."""
    if copy_threads is None:
        return 1
    if transfer_mode != TransferMode.ENGINE_DRIVEN.value:
        raise ValueError(
            "copy_threads applies to engine_driven workers: the server copies for server_driven ones"
        )
    if not 1 <= copy_threads <= MAX_COPY_THREADS:
        raise ValueError(f"copy_threads must be in [1, {MAX_COPY_THREADS}]")
    return copy_threads


def check_kv_compression(transfer_mode: str, kv_compression: str) -> str:
    """How an engine's chunks are stored: "none" (its KV as is) or "int8" (quantized by the
    worker as it copies, so engine-driven transfers only)."""
    if kv_compression not in KV_CODECS:
        raise ValueError(f"kv_compression {kv_compression!r}: use {' or '.join(map(repr, KV_CODECS))}")
    if kv_compression != "none" and transfer_mode != TransferMode.ENGINE_DRIVEN.value:
        raise ValueError(
            f"kv_compression {kv_compression!r} needs engine_driven transfers: the worker quantizes "
            "as it copies (a server-driven server copies raw KV only)"
        )
    return kv_compression
