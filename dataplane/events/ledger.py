"""What the events have said each chunk is held on, turning tier changes into vLLM KV events.

Used by the publisher's thread alone (no lock). A chunk is described (`describe`) by the module
that stores it before it lands; ``stored`` then announces it on a medium, ``removed`` withdraws
it, and a chunk's description is forgotten once no medium holds it. Descriptions of chunks that
never land (a refused store) are kept for at most ``MAX_UNCLAIMED`` chunks, oldest dropped. A
chunk that lands without a description (one read back from the file tier after a restart, or
from the shared remote tier) is not announced: a router is told less, never something untrue.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from dataplane.events import vllm_format as fmt
from dataplane.events.vllm_format import ChunkMeta

MAX_UNCLAIMED = 1 << 16
MAX_HASHES_PER_REMOVAL = 4096  # a withdrawal of a whole medium is split into events of this many


class Ledger:
    def __init__(self, max_unclaimed: int = MAX_UNCLAIMED) -> None:
        self.max_unclaimed = max_unclaimed
        self._unclaimed: OrderedDict[bytes, ChunkMeta] = OrderedDict()
        self._held: dict[bytes, tuple[ChunkMeta, set[str]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def describe(self, key: bytes, meta: ChunkMeta) -> None:
        held = self._held.get(key)
        if held is not None:
            return  # (announced already: its first description stands)
        self._unclaimed[key] = meta
        self._unclaimed.move_to_end(key)
        while len(self._unclaimed) > self.max_unclaimed:
            self._unclaimed.popitem(last=False)

    def stored(self, key: bytes, medium: str) -> dict[str, Any] | None:
        held = self._held.get(key)
        if held is None:
            meta = self._unclaimed.pop(key, None)
            if meta is None:
                return None
            held = self._held[key] = (meta, set())
        meta, media = held
        if medium in media:
            return None
        media.add(medium)
        tokens = np.frombuffer(meta.token_ids, dtype="<i4").tolist()
        return fmt.stored(meta, medium, tokens)

    def removed(self, key: bytes, medium: str) -> dict[str, Any] | None:
        held = self._held.get(key)
        if held is None or medium not in held[1]:
            return None
        meta, media = held
        media.discard(medium)
        if not media:
            del self._held[key]
        return fmt.removed(meta.block_hashes, medium)

    def removed_all(self, medium: str) -> list[dict[str, Any]]:
        """Withdraw every chunk announced on ``medium`` (the health monitor stopped using it)."""
        hashes: list[fmt.BlockHash] = []
        for key in [k for k, (_, media) in self._held.items() if medium in media]:
            meta, media = self._held[key]
            media.discard(medium)
            if not media:
                del self._held[key]
            hashes.extend(meta.block_hashes)
        step = MAX_HASHES_PER_REMOVAL
        return [fmt.removed(hashes[i : i + step], medium) for i in range(0, len(hashes), step)]

    def cleared(self) -> dict[str, Any]:
        self._held.clear()
        return fmt.cleared()
