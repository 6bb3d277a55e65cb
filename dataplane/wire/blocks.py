"""The engine's own names for the blocks a store covers, for KV events (`dataplane.events`).

A STORE (and ENGINE_STORE, ENGINE_RESERVE) may carry ``blocks``: the engine's hash of every full
block of its ``token_ids`` from the first, its block size, LoRA adapter name and vLLM's extra
keys per block, so the server's events name blocks as the engine's own events do (a router
matches them). The server only repeats these values: they never change a chunk's key.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from dataplane.wire.checks import MAX_NAME_LEN, small_int, type_name, wire_type
from dataplane.wire.errors import ProtocolError
from dataplane.wire.records import Record, decode_record

MAX_BLOCK_HASHES = 1 << 17
MAX_HASH_BYTES = 64
MAX_EXTRA_ITEMS = 16  # per block
MAX_EXTRA_SCALAR = 256  # bytes of a str or bin item
MAX_BLOCK_SIZE = 1 << 16

BlockHash = int | bytes


@wire_type(f"array of at most 2^17 hashes, each a u64 int or bin of 1-{MAX_HASH_BYTES} bytes")
def _hashes(v: Any, where: str) -> tuple[BlockHash, ...]:
    if not isinstance(v, list):
        raise ProtocolError(f"{where}: expected an array of block hashes, got {type_name(v)}")
    if len(v) > MAX_BLOCK_HASHES:
        raise ProtocolError(f"{where}: {len(v)} hashes exceeds the limit of {MAX_BLOCK_HASHES}")
    for i, h in enumerate(v):
        if type(h) is int:
            if not 0 <= h < 1 << 64:
                raise ProtocolError(f"{where}[{i}]: {h} is not a u64")
        elif not isinstance(h, bytes) or not 0 < len(h) <= MAX_HASH_BYTES:
            raise ProtocolError(
                f"{where}[{i}]: expected a u64 int or 1-{MAX_HASH_BYTES} bytes, got {type_name(h)}"
            )
    return tuple(v)


def _scalar(x: Any, where: str) -> None:
    if x is None or type(x) in (bool, int, float):
        return
    if isinstance(x, str | bytes):
        if len(x) > MAX_EXTRA_SCALAR:
            raise ProtocolError(f"{where}: {len(x)} long, over the limit of {MAX_EXTRA_SCALAR}")
        return
    if isinstance(x, list) and len(x) <= MAX_EXTRA_ITEMS:  # ((mm id, offset) pairs)
        for j, y in enumerate(x):
            if isinstance(y, list):
                raise ProtocolError(f"{where}[{j}]: nested too deep")
            _scalar(y, f"{where}[{j}]")
        return
    raise ProtocolError(f"{where}: expected a scalar (nil, bool, int, float, str, bin), got {type_name(x)}")


@wire_type(f"nil, or an array (one per hash) of nil or arrays of at most {MAX_EXTRA_ITEMS} scalars")
def _extra_keys(v: Any, where: str) -> tuple[tuple[Any, ...] | None, ...] | None:
    if v is None:
        return None
    if not isinstance(v, list) or len(v) > MAX_BLOCK_HASHES:
        raise ProtocolError(f"{where}: expected nil or an array of at most {MAX_BLOCK_HASHES} items")
    out: list[tuple[Any, ...] | None] = []
    for i, item in enumerate(v):
        if item is None:
            out.append(None)
            continue
        if not isinstance(item, list) or len(item) > MAX_EXTRA_ITEMS:
            raise ProtocolError(f"{where}[{i}]: expected nil or an array of at most {MAX_EXTRA_ITEMS} items")
        for j, x in enumerate(item):
            _scalar(x, f"{where}[{i}][{j}]")
        out.append(tuple(item))
    return tuple(out)


@wire_type(f"nil or str of 1-{MAX_NAME_LEN} chars")
def _opt_name(v: Any, where: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME_LEN:
        raise ProtocolError(f"{where}: expected nil or a string of 1-{MAX_NAME_LEN} chars")
    return v


@dataclasses.dataclass(frozen=True, slots=True)
class EngineBlocks(Record):
    block_size: Annotated[int, small_int(1, MAX_BLOCK_SIZE), "the engine's tokens per block"]
    hashes: Annotated[
        tuple[BlockHash, ...], _hashes, "the engine's hash of each full block of token_ids, from the first"
    ]
    lora_name: Annotated[str | None, _opt_name, "the LoRA adapter's name, as the engine's events give it"] = (
        None
    )
    extra_keys: Annotated[
        tuple[tuple[Any, ...] | None, ...] | None, _extra_keys, "vLLM's extra keys, one entry per hash"
    ] = None

    def _checked(self, where: str) -> EngineBlocks:
        if self.extra_keys is not None and len(self.extra_keys) != len(self.hashes):
            raise ProtocolError(
                f"{where}.extra_keys: {len(self.extra_keys)} entries for {len(self.hashes)} hashes"
            )
        return self


@wire_type("`EngineBlocks` or nil")
def opt_engine_blocks(v: Any, where: str) -> EngineBlocks | None:
    return None if v is None else decode_record(EngineBlocks, v, where)


# the last field of STORE, ENGINE_STORE and ENGINE_RESERVE
EngineBlocksField = Annotated[
    EngineBlocks | None, opt_engine_blocks, "the engine's names of the blocks, or nil"
]
