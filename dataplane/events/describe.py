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
from typing import Any

import numpy as np

from dataplane.events.sink import EventSink
from dataplane.events.vllm_format import ChunkMeta
from dataplane.wire.blocks import BlockHash, EngineBlocks
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


class NameBook:
    """What the engine's names of stored blocks tell a router's lookup (`POST /v1/lookup`),
    learnt from the stores that carry them (the vLLM connector's):

    - a LoRA adapter's name -> the key namespace its chunks are stored under;
    - (model, the engine's hash of a chunk's last block) -> (scope, chunk key): a block hash
      names its whole prefix (vLLM chains them, the salt and adapter folded in), so a prompt's
      hashes find its chunks.

    At most ``MAX_ADAPTERS`` and ``MAX_HASHES`` entries, the oldest forgotten (a forgotten hash
    is a miss for a lookup by hashes, never a wrong answer). ``_lock`` guards both maps."""

    MAX_ADAPTERS = 4096
    MAX_HASHES = 1 << 18

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._adapters: OrderedDict[str, bytes] = OrderedDict()
        self._hashes: OrderedDict[tuple[str, BlockHash], tuple[bytes, bytes]] = OrderedDict()

    def learn(
        self,
        model: str,
        scope: bytes,
        blocks: EngineBlocks | None,
        ctx: KeyContext | None,
        keys: Sequence[bytes],
        first: int,
        chunk_size: int,
    ) -> None:
        """``keys``: those of chunks ``first ..``; ``blocks`` checked already (`check_blocks`)."""
        if blocks is None:
            return
        per = chunk_size // blocks.block_size
        with self._lock:
            if blocks.lora_name is not None and ctx is not None and ctx.namespace:
                _put(self._adapters, blocks.lora_name, ctx.namespace, self.MAX_ADAPTERS)
            for i, key in enumerate(keys):
                _put(
                    self._hashes,
                    (model, blocks.hashes[(first + i + 1) * per - 1]),
                    (scope, key),
                    self.MAX_HASHES,
                )

    def namespace(self, name: str) -> bytes | None:
        with self._lock:
            return self._adapters.get(name)

    def chunks(self, model: str, hashes: Sequence[BlockHash], per: int) -> tuple[bytes, list[bytes]]:
        """(scope, the keys of the leading chunks ``hashes`` name, ``per`` blocks a chunk), up to
        the first chunk not known (or of another scope)."""
        scope, keys = b"", list[bytes]()
        with self._lock:
            for c in range(len(hashes) // per):
                found = self._hashes.get((model, hashes[(c + 1) * per - 1]))
                if found is None or (keys and found[0] != scope):
                    break
                scope = found[0]
                keys.append(found[1])
        return scope, keys


def _put(d: OrderedDict[Any, Any], k: Any, v: Any, cap: int) -> None:
    d[k] = v
    d.move_to_end(k)
    while len(d) > cap:
        d.popitem(last=False)
