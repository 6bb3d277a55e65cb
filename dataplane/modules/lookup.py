"""The lookup module: LOOKUP answers how many prefix tokens the server holds for an instance;
LOOKUP_SCOPE the same for a scope named by its fields (an engine's scheduler, which registers
no memory), the prefix every rank of the scope holds, or, with a window, whether the last chunks
of the prefix are held (all that a sliding-window layer group needs). Both also answer how many
tokens after those are being stored now (`dataplane.storage.l1.inflight`): a scheduler may hold
the request back until they land. LOOKUP_WAITED is such a scheduler's report of a wait, counted
in /metrics. PREFETCH_SCOPE is LOOKUP_SCOPE's read-ahead alone (a scheduler just given a
request): what the slower tiers hold of its prefix starts coming into L1, and nothing is
counted."""

from __future__ import annotations

from typing import Protocol

from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext
from dataplane.storage.keys import chunk_keys, filing_scope, scope_digest
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.tenants import tenant_of
from dataplane.wire.errors import NotRegistered
from dataplane.wire.messages import (
    Lookup,
    LookupScope,
    LookupWaited,
    MsgType,
    PrefetchScope,
    ScopeName,
    ScopeRequest,
)
from dataplane.wire.replies import Hits, Noted, ScopeHits


def scopes_named(p: ScopeName, kv_codec: str = "none") -> list[bytes]:
    """Every rank's scope digest of ``p`` with chunks stored as ``kv_codec`` (one for a format
    every rank holds alike)."""
    return [
        scope_digest(
            p.model_name,
            p.world_size,
            rank,
            p.dtype,
            p.num_layers,
            p.heads,
            p.head_dim,
            p.kv_format.value,
            p.block_size,
            kv_codec,
        )
        for rank in range(1 if p.kv_format.replicated else p.world_size)
    ]


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
            MsgType.LOOKUP_WAITED: Handler(self._waited),
            MsgType.PREFETCH_SCOPE: Handler(self._prefetch_scope),
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
        held, reach = self._reach(keys, filing_scope(scope, p.key), tenant_of(p.key))
        return Hits(*self._answer(len(p.token_ids), held, reach))

    def _lookup_scope(self, rctx: RequestContext, p: LookupScope) -> ScopeHits:
        held, reach, in_l1, to_disk = self._scope_reach(p)
        hit, pending = self._answer(len(p.token_ids), held, reach)
        cs = self.chunk_size
        return ScopeHits(hit, cs, pending, in_l1 * cs, (to_disk - in_l1) * cs)

    def _prefetch_scope(self, rctx: RequestContext, p: PrefetchScope) -> Noted:
        self.metrics.prefetches.inc()
        self._scope_reach(p)  # (the read-ahead is what LOOKUP_SCOPE starts; the answer is not wanted)
        return Noted(True)

    def _scope_reach(self, p: ScopeRequest) -> tuple[int, int, int, int]:
        """(chunks every rank's scope holds, those and the chunks being stored right after, the
        chunks every rank's scope holds in L1 as asked (before the lower tiers' read-ahead),
        those and the chunks every rank's file tier continues them by), each within the first."""
        held = reach = in_l1 = to_disk = len(p.token_ids) // self.chunk_size
        for scope in scopes_named(p, p.kv_codec):
            if reach == 0:
                break
            keys = chunk_keys(scope, p.token_ids[: reach * self.chunk_size], self.chunk_size, p.key)
            h, r, l1, d = self._window(keys, filing_scope(scope, p.key), tenant_of(p.key), p.window)
            held, reach, in_l1, to_disk = min(held, h), min(reach, r), min(in_l1, l1), min(to_disk, d)
        in_l1 = min(in_l1, held)
        return held, reach, in_l1, max(in_l1, min(to_disk, held))

    def _window(
        self, keys: list[bytes], scope: bytes, tenant: bytes, window: int
    ) -> tuple[int, int, int, int]:
        """(held, reach, in L1, in L1 or on disk) of one rank's ``keys``: a prefix, or, with
        ``window`` > 0, all of ``keys`` when their last ``window`` chunks are held (a
        sliding-window layer group needs no more; where its lower tiers' chunks are is not
        told), else the prefix held."""
        n, w = len(keys), min(window, len(keys))
        if w:
            tail = keys[n - w :]
            in_l1 = n if self.l1.peek_prefix(tail) == w else 0  # (asked before the read-ahead)
            if self.l1.prefix_hits(tail, scope, tenant) == w:
                return n, n, in_l1, in_l1
        l1, fs, remote = self.l1.prefix_split(keys, scope, tenant)
        held = l1 + fs + remote
        return held, held + self.l1.inflight.run(keys[held:]), l1, l1 + fs

    def _waited(self, rctx: RequestContext, p: LookupWaited) -> Noted:
        self.metrics.lookup_waits.labels(outcome=p.outcome).inc()
        self.metrics.lookup_wait_seconds.observe(p.waited_s)
        return Noted(True)

    def _reach(self, keys: list[bytes], scope: bytes, tenant: bytes) -> tuple[int, int]:
        """(the chunks held, those and the chunks being stored right after them)."""
        held = self.l1.prefix_hits(keys, scope, tenant)
        return held, held + self.l1.inflight.run(keys[held:])

    def _answer(self, tokens: int, held: int, reach: int) -> tuple[int, int]:
        """(hit tokens, pending tokens) of the chunks held and reached, counted in the metrics."""
        hit, pending = held * self.chunk_size, (reach - held) * self.chunk_size
        self.metrics.lookup_tokens.inc(tokens)
        self.metrics.hit_tokens.inc(hit)
        if pending:
            self.metrics.pending_tokens.inc(pending)
        return hit, pending
