"""The lookup module: LOOKUP answers how many prefix tokens the server holds for an instance;
LOOKUP_SCOPE the same for a scope named by its fields (an engine's scheduler, which registers
no memory), the prefix every rank of the scope holds."""

from __future__ import annotations

from typing import Protocol

from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.storage.keys import chunk_keys, scope_digest
from dataplane.storage.l1 import L1Store
from dataplane.wire.errors import NotRegistered
from dataplane.wire.messages import Lookup, LookupScope, MsgType
from dataplane.wire.replies import Hits, ScopeHits


class ScopeSource(Protocol):
    def scope_of(self, instance_id: int, conn_fd: int = -1, secret: bytes | None = None) -> bytes | None: ...


class LookupModule:
    name = "lookup"

    def __init__(
        self, l1: L1Store, chunk_size: int, metrics: DataPlaneMetrics, sources: list[ScopeSource]
    ) -> None:
        self.l1 = l1
        self.chunk_size = chunk_size
        self.metrics = metrics
        self.sources = sources

    def handlers(self) -> dict[MsgType, Handler]:
        return {
            MsgType.LOOKUP: Handler(self._lookup),
            MsgType.LOOKUP_SCOPE: Handler(self._lookup_scope),
        }

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None

    def _lookup(self, rctx: RequestContext, p: Lookup) -> Hits:
        for src in self.sources:
            scope = src.scope_of(p.instance_id, rctx.conn_fd, p.secret)
            if scope is not None:
                break
        else:
            raise NotRegistered(f"instance {p.instance_id} is not registered")
        keys = chunk_keys(scope, p.token_ids, self.chunk_size, p.key)
        return Hits(self._answer(len(p.token_ids), self.l1.prefix_hits(keys)))

    def _lookup_scope(self, rctx: RequestContext, p: LookupScope) -> ScopeHits:
        chunks = len(p.token_ids) // self.chunk_size
        for rank in range(p.world_size):
            if chunks == 0:
                break
            scope = scope_digest(
                p.model_name,
                p.world_size,
                rank,
                p.dtype,
                p.num_layers,
                p.heads,
                p.head_dim,
                p.kv_format.value,
                p.block_size,
            )
            keys = chunk_keys(scope, p.token_ids[: chunks * self.chunk_size], self.chunk_size, p.key)
            chunks = min(chunks, self.l1.prefix_hits(keys))
        return ScopeHits(self._answer(len(p.token_ids), chunks), self.chunk_size)

    def _answer(self, tokens: int, chunks: int) -> int:
        """The hit tokens of ``chunks`` held chunks, counted in the metrics."""
        hit = chunks * self.chunk_size
        self.metrics.lookup_tokens.inc(tokens)
        self.metrics.hit_tokens.inc(hit)
        return hit
