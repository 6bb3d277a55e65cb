"""The lookup module: LOOKUP answers how many prefix tokens the server holds for an instance."""

from __future__ import annotations

from typing import Any, Protocol

from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, HandlerKind, RequestContext
from dataplane.storage.keys import chunk_keys
from dataplane.storage.l1 import L1Store
from dataplane.wire.errors import NotRegistered
from dataplane.wire.messages import Lookup, MsgType


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
        return {MsgType.LOOKUP: Handler(HandlerKind.NORMAL, self._lookup)}

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None

    def report_status(self) -> dict[str, Any]:
        return {}

    def _lookup(self, rctx: RequestContext, p: Lookup) -> dict[str, Any]:
        for src in self.sources:
            scope = src.scope_of(p.instance_id, rctx.conn_fd, p.secret)
            if scope is not None:
                break
        else:
            raise NotRegistered(f"instance {p.instance_id} is not registered")
        keys = chunk_keys(scope, p.token_ids, self.chunk_size)
        hit = self.l1.prefix_hits(keys) * self.chunk_size
        self.metrics.lookup_tokens.inc(len(p.token_ids))
        self.metrics.hit_tokens.inc(hit)
        return {"hit_tokens": hit}
