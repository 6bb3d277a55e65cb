"""Tenants of L1: each chunk's tenant, what each tenant holds, and its share.

A tenant is the salt of the requests that stored a chunk (`dataplane.wire.context.KeyContext`;
no salt is the tenant of everything unsalted). The salt is a secret: a tenant is known by a
keyed digest of it (``tenant_of``), under a key made at each start, so neither an id nor its
label (``label``) can be traced back to a salt, or matched across restarts.

``TenantBook`` is L1's ledger, kept under L1's lock: bytes held (committed and reserved), the
tenant's chunks in least-recently-used order, hits and evictions. With a share (``l1_tenant_share``
of L1's capacity), a tenant that holds its share makes room for a new chunk by evicting its own
least-recently-used chunks, never another tenant's. ``top`` is what /status and /metrics show:
the tenants holding most, at most ``TOP_TENANTS`` of them and the rest summed under ``other``,
so a server with thousands of tenants still shows a bounded number of series.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from dataplane.wire.context import KeyContext

NO_TENANT = b""  # requests without a salt
TOP_TENANTS = 16
_KEY = secrets.token_bytes(32)  # this process's: ids and labels do not outlive it


def tenant_of(ctx: KeyContext | None) -> bytes:
    """The tenant of a request: a keyed digest of its salt (``NO_TENANT`` without one)."""
    if ctx is None or not ctx.salt:
        return NO_TENANT
    return hashlib.blake2b(ctx.salt, key=_KEY, digest_size=8, person=b"kvwarden-tenant").digest()


def label(tenant: bytes) -> str:
    return "unsalted" if tenant == NO_TENANT else "t-" + tenant.hex()


@dataclass
class TenantStats:
    tenant: str  # its label, "other" for the rest summed
    bytes: int
    chunks: int
    hits: int  # chunks served to its requests
    evictions: int  # of its chunks, by anyone's store


@dataclass
class _Ledger:
    held: int = 0  # bytes
    chunks: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # oldest first
    hits: int = 0
    evictions: int = 0


class TenantBook:
    """Called under L1's lock only (it has no lock of its own)."""

    def __init__(self, share_bytes: int | None) -> None:
        self.share_bytes = share_bytes  # None: no share (any store evicts the least recent)
        self._t: dict[bytes, _Ledger] = {}

    def _of(self, tenant: bytes) -> _Ledger:
        led = self._t.get(tenant)
        if led is None:
            led = self._t[tenant] = _Ledger()
        return led

    def excess(self, tenant: bytes, nbytes: int) -> int:
        """Bytes ``tenant`` must give up before ``nbytes`` more stay within its share (<= 0:
        none; always so without shares)."""
        if self.share_bytes is None:
            return 0
        led = self._t.get(tenant)
        return (led.held if led is not None else 0) + nbytes - self.share_bytes

    def own_oldest(self, tenant: bytes) -> Iterator[bytes]:
        """The tenant's chunks, least recently used first (evict none while iterating)."""
        led = self._t.get(tenant)
        return iter(led.chunks if led is not None else ())

    def add_bytes(self, tenant: bytes, nbytes: int) -> None:
        """A reserve (or, negative, a reserve given back)."""
        led = self._of(tenant)
        led.held += nbytes
        self._forget_if_empty(tenant, led)

    def committed(self, tenant: bytes, key: bytes) -> None:
        self._of(tenant).chunks[key] = None

    def touched(self, tenant: bytes, key: bytes, hit: bool) -> None:
        led = self._t.get(tenant)
        if led is not None and key in led.chunks:
            led.chunks.move_to_end(key)
            led.hits += hit

    def dropped(self, tenant: bytes, key: bytes, nbytes: int, evicted: bool) -> None:
        led = self._of(tenant)
        led.chunks.pop(key, None)
        led.held -= nbytes
        led.evictions += evicted
        self._forget_if_empty(tenant, led)

    def _forget_if_empty(self, tenant: bytes, led: _Ledger) -> None:
        # a tenant that holds nothing is forgotten (its counts with it): the book stays as
        # large as what L1 holds, however many tenants come and go
        if led.held <= 0 and not led.chunks:
            self._t.pop(tenant, None)

    def top(self, n: int = TOP_TENANTS) -> list[TenantStats]:
        ranked = sorted(self._t.items(), key=lambda kv: kv[1].held, reverse=True)
        out = [TenantStats(label(t), d.held, len(d.chunks), d.hits, d.evictions) for t, d in ranked[:n]]
        rest = [d for _, d in ranked[n:]]
        if rest:
            out.append(
                TenantStats(
                    "other",
                    sum(d.held for d in rest),
                    sum(len(d.chunks) for d in rest),
                    sum(d.hits for d in rest),
                    sum(d.evictions for d in rest),
                )
            )
        return out
