"""What L1 reports (`dataplane.storage.l1.store.L1Store.stats`)."""

from __future__ import annotations

from dataclasses import dataclass

from dataplane.storage.l1.arena import ArenaStats
from dataplane.storage.l1.tenants import TenantStats


@dataclass
class L1Stats:
    used_bytes: int
    capacity_bytes: int
    chunks: int
    hot_cache: bool
    evictions: int
    rejected: int
    arena: ArenaStats | None = None
    fragmentation: float = 0.0  # of the free space: 1 - largest free extent / free bytes
    tenants: list[TenantStats] | None = None  # those holding most, the rest as "other"
    tenant_share_bytes: int | None = None
    inflight_chunks: int = 0  # being written, not yet committed (`dataplane.storage.l1.inflight`)
    inflight_stores: int = 0
    hits: int = 0  # chunks readers found in L1 (not those a lower tier brought in for them)
    share_evictions: int = 0  # of ``evictions``: a tenant's own, to keep it within its share
    policy: str = "lru"  # the eviction order (`dataplane.storage.evict`)

    def evictions_by_reason(self) -> dict[str, int]:
        """capacity: to make room; tenant_share: a tenant's own, to keep it within its share."""
        return {"capacity": self.evictions - self.share_evictions, "tenant_share": self.share_evictions}


@dataclass(frozen=True, slots=True)
class ScopeCleared:
    """What a clear of one scope removed, tier by tier (`L1Store.clear_scope`, and
    `dataplane.storage.tiered.TieredStore`'s, which clears the lower tiers too)."""

    l1: int  # chunks dropped from L1
    fs: int | None = None  # chunk files removed (None: no file tier, or it failed)
    remote: int | None = None  # chunks removed from the remote tier (None: none, or it failed)
    pinned: int = 0  # L1 chunks a reader still held at the deadline: they stay
    failed: tuple[str, ...] = ()  # tiers that could not be cleared (down, an error)

    @property
    def removed(self) -> int:
        return self.l1 + (self.fs or 0) + (self.remote or 0)

    @property
    def complete(self) -> bool:
        """Nothing of the scope is left in any tier (as far as this server can tell)."""
        return not self.failed and not self.pinned
