"""vLLM's KV-event wire format (``vllm/distributed/kv_events.py``), encoded without msgspec.

A message on the PUB socket is three frames: ``(topic, sequence as 8 bytes big-endian,
payload)``. The payload is an ``EventBatch`` as msgspec encodes it: an array ``[ts, events]``
(``data_parallel_rank`` omitted: kvwarden is not a data-parallel rank), each event a map tagged
``"type"`` with the struct's fields, those with defaults omitted when they hold them. The replay
ROUTER answers a request ``[b"", start_seq]`` with ``[b"", topic, seq, payload]`` per buffered
batch from ``start_seq`` on, then the end marker ``[b"", b"", END_SEQ, b""]``.

Media: L1 is ``"CPU"``, the file tier ``"DISK"``, the shared remote tier ``"EXTERNAL"``; every
event kvwarden publishes carries ``ownership="kvwarden"`` (vLLM's field for "the secondary
offloading tier that generated it").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

BlockHash = int | bytes  # vLLM's ExternalBlockHash
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"
MEDIUM_EXTERNAL = "EXTERNAL"
OWNERSHIP = "kvwarden"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a chunk's events say of it: the engine's block hashes over its tokens (or the
    chunk's own, one per chunk, where no engine gave them), the hash before them, its tokens,
    the engine's block size, the LoRA adapter's name and vLLM's extra keys per block."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: bytes  # little-endian int32
    block_size: int
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def stored(meta: ChunkMeta, medium: str, token_ids: Sequence[int]) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(meta.block_hashes),
        "parent_block_hash": meta.parent_block_hash,
        "token_ids": list(token_ids),
        "block_size": meta.block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": meta.lora_name,
    }
    if meta.extra_keys is not None:
        ev["extra_keys"] = list(meta.extra_keys)
    ev["ownership"] = OWNERSHIP
    return ev


def removed(block_hashes: Sequence[BlockHash], medium: str) -> dict[str, Any]:
    return {
        "type": "BlockRemoved",
        "block_hashes": list(block_hashes),
        "medium": medium,
        "ownership": OWNERSHIP,
    }


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def batch(ts: float, events: list[dict[str, Any]]) -> bytes:
    """An ``EventBatch`` payload."""
    out: bytes = msgpack.packb([ts, events], use_bin_type=True)
    return out
