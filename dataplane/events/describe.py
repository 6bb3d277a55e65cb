"""What a store tells the events of the chunks it is about to write (`EventSink.describe`).

With the engine's names (`dataplane.wire.blocks.EngineBlocks`), chunk ``c`` is the engine's
blocks ``c * per .. (c + 1) * per - 1`` (``per`` = chunk size / block size), its parent the
block before them. Without them, a chunk is named by its own key (the first 8 bytes of it as a
u64, as vLLM's integer block hashes are), one block of ``chunk_size`` tokens, its parent the
chunk before it: a stream kvwarden's own clients can follow, which no engine's hashes match.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from dataplane.events.sink import EventSink
from dataplane.events.vllm_format import ChunkMeta
from dataplane.wire.blocks import EngineBlocks
from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.context import KeyContext
from dataplane.wire.errors import RequestError


def native_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")


def check_blocks(blocks: EngineBlocks | None, chunk_size: int, n_chunks: int) -> None:
    """RequestError when ``blocks`` cannot name the first ``n_chunks`` chunks."""
    if blocks is None:
        return
    bs = blocks.block_size
    if chunk_size % bs:
        raise RequestError(f"blocks.block_size: {bs} does not divide the server's chunk size {chunk_size}")
    need = n_chunks * (chunk_size // bs)
    if len(blocks.hashes) < need:
        raise RequestError(
            f"blocks.hashes: {len(blocks.hashes)} hashes name fewer than the {need} blocks of the "
            f"{n_chunks} chunks stored"
        )


def describe(
    sink: EventSink,
    keys: Sequence[bytes],
    first: int,
    token_ids: np.ndarray,
    chunk_size: int,
    blocks: EngineBlocks | None,
    prev_key: bytes | None,
) -> None:
    """Describe ``keys``, the keys of chunks ``first ..`` of ``token_ids``; ``prev_key``: the
    key of chunk ``first - 1`` (None for the first chunk). ``blocks`` is checked already."""
    if not sink.enabled:
        return
    raw = np.ascontiguousarray(token_ids, dtype=ID_DTYPE).tobytes()
    step = chunk_size * ID_DTYPE.itemsize
    prev = prev_key
    for i, key in enumerate(keys):
        c = first + i
        toks = raw[c * step : (c + 1) * step]
        if blocks is not None:
            per = chunk_size // blocks.block_size
            lo = c * per
            extra = None if blocks.extra_keys is None else blocks.extra_keys[lo : lo + per]
            meta = ChunkMeta(
                blocks.hashes[lo : lo + per],
                blocks.hashes[lo - 1] if lo else None,
                toks,
                blocks.block_size,
                blocks.lora_name,
                extra,
            )
        else:
            meta = ChunkMeta(
                (native_hash(key),), None if prev is None else native_hash(prev), toks, chunk_size
            )
        sink.describe(key, meta)
        prev = key


class AdapterNames:
    """LoRA adapter name -> the key namespace its chunks are stored under, learnt from stores
    that name both (the vLLM connector's do), so a router may ask by name (`POST /v1/lookup`).
    At most ``MAX_ADAPTERS``, the oldest forgotten. ``_lock`` guards ``_names``."""

    MAX_ADAPTERS = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: OrderedDict[str, bytes] = OrderedDict()

    def learn(self, blocks: EngineBlocks | None, ctx: KeyContext | None) -> None:
        if blocks is None or blocks.lora_name is None or ctx is None or not ctx.namespace:
            return
        with self._lock:
            self._names[blocks.lora_name] = ctx.namespace
            self._names.move_to_end(blocks.lora_name)
            while len(self._names) > self.MAX_ADAPTERS:
                self._names.popitem(last=False)

    def namespace(self, name: str) -> bytes | None:
        with self._lock:
            return self._names.get(name)
