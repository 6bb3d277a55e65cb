"""Tenants of L1: each tenant's bytes, hits and evictions, and shares (a tenant at its share
evicts only its own chunks), on a real L1 store; the ids and labels never show a salt."""

from __future__ import annotations

import pytest

from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.tenants import NO_TENANT, TOP_TENANTS, TenantBook, label, tenant_of
from dataplane.wire.context import KeyContext

N = 1024  # bytes per chunk
A, B = tenant_of(KeyContext(b"tenant-a")), tenant_of(KeyContext(b"tenant-b"))


def key(t: bytes, i: int) -> bytes:
    return t + i.to_bytes(8, "little")


def put(l1: L1Store, t: bytes, i: int) -> bool:
    buf = l1.reserve(N, t)
    if buf is None:
        return False
    assert l1.commit(key(t, i), buf)
    return True


def held(l1: L1Store, t: bytes, n: int) -> list[int]:
    """Which of ``t``'s chunks 0..n-1 L1 holds."""
    absent, pinned = l1.pin_present([key(t, i) for i in range(n)])
    l1.release(pinned)
    return [i for i in range(n) if i not in absent]


def by_label(l1: L1Store) -> dict[str, tuple[int, int, int, int]]:
    return {t.tenant: (t.bytes, t.chunks, t.hits, t.evictions) for t in l1.stats().tenants or []}


def test_tenant_ids_are_keyed_digests_that_show_no_salt() -> None:
    assert tenant_of(None) == tenant_of(KeyContext()) == tenant_of(KeyContext(namespace=b"lora")) == NO_TENANT
    assert tenant_of(KeyContext(b"tenant-a", b"lora:x")) == A and A != B and len(A) == 8
    assert label(NO_TENANT) == "unsalted" and label(A) == "t-" + A.hex()
    assert "tenant" not in label(A) and b"tenant-a".hex() not in label(A)


def test_without_shares_a_burst_evicts_the_least_recent_whoever_holds_it() -> None:
    l1 = L1Store(8 * N)
    for i in range(4):
        assert put(l1, B, i)
    for i in range(8):
        assert put(l1, A, i)
    assert held(l1, B, 4) == [] and held(l1, A, 8) == list(range(8))
    assert by_label(l1) == {label(A): (8 * N, 8, 0, 0)}  # B held nothing any more: forgotten
    assert l1.stats().tenant_share_bytes is None


def test_with_shares_a_tenant_at_its_share_evicts_only_its_own_chunks() -> None:
    l1 = L1Store(8 * N, tenant_share_bytes=4 * N)
    for i in range(3):
        assert put(l1, B, i)
    for i in range(10):  # a burst of ten chunks: it keeps its newest four
        assert put(l1, A, i)
    assert held(l1, B, 3) == [0, 1, 2]
    assert held(l1, A, 10) == [6, 7, 8, 9]
    assert by_label(l1) == {label(A): (4 * N, 4, 0, 6), label(B): (3 * N, 3, 0, 0)}
    assert l1.stats().used_bytes == 7 * N and l1.stats().evictions == 6
    # below its share a tenant evicts the least recent of anyone's when L1 is full
    assert put(l1, NO_TENANT, 0)
    assert put(l1, NO_TENANT, 1)
    assert held(l1, B, 3) == [1, 2] and held(l1, A, 10) == [6, 7, 8, 9]
    s = l1.stats()
    assert (s.evictions, s.share_evictions) == (7, 6)  # B's oldest went for room: capacity


def test_a_tenant_whose_own_chunks_are_all_pinned_is_refused_and_evicts_no_one_elses() -> None:
    l1 = L1Store(8 * N, tenant_share_bytes=2 * N)
    assert put(l1, B, 0)
    assert put(l1, A, 0) and put(l1, A, 1)
    got = l1.acquire_prefix([key(A, 0), key(A, 1)])  # a reader holds both
    assert len(got) == 2
    assert l1.reserve(N, A) is None
    assert held(l1, B, 1) == [0] and l1.stats().rejected == 1
    l1.release([key(A, 0), key(A, 1)])
    assert put(l1, A, 2) and held(l1, A, 3) == [1, 2]


def test_hits_reserves_aborts_and_duplicates_are_counted_exactly() -> None:
    l1 = L1Store(8 * N, tenant_share_bytes=8 * N)
    assert put(l1, A, 0)
    buf = l1.reserve(N, A)
    assert buf is not None and by_label(l1)[label(A)][0] == 2 * N  # reserved bytes count
    l1.abort(buf)
    dup = l1.reserve(N, A)
    assert dup is not None and not l1.commit(key(A, 0), dup)  # already held: the bytes go back
    assert by_label(l1)[label(A)] == (N, 1, 0, 0)
    assert len(l1.acquire_prefix([key(A, 0)], A)) == 1  # a hit
    l1.release([key(A, 0)])
    assert l1.prefix_hits([key(A, 0)]) == 1  # a lookup is not a hit
    assert by_label(l1)[label(A)] == (N, 1, 1, 0)
    assert l1.discard([key(A, 0)]) == 1 and by_label(l1) == {}
    quarantined = l1.reserve(N, B)
    assert quarantined is not None
    l1.quarantine(quarantined)
    assert by_label(l1) == {} and l1.stats().used_bytes == N  # L1's until the quarantine ends


def test_top_is_bounded_and_sums_the_rest() -> None:
    book = TenantBook(None)
    tenants = [tenant_of(KeyContext(f"t{i}".encode())) for i in range(TOP_TENANTS + 5)]
    for n, t in enumerate(tenants):
        book.add_bytes(t, (n + 1) * N)
    top = book.top()
    assert len(top) == TOP_TENANTS + 1 and top[-1].tenant == "other"
    assert top[0].tenant == label(tenants[-1]) and top[-1].bytes == sum((n + 1) * N for n in range(5))


def test_a_share_larger_than_l1_changes_nothing_and_shares_are_rejected_as_settings() -> None:
    from dataplane.server.config import Settings

    assert Settings(l1_size_gb=1, l1_tenant_share=0.25).l1_tenant_share_bytes == 1 << 28
    assert Settings().l1_tenant_share_bytes is None
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="l1_tenant_share"):
            Settings(l1_tenant_share=bad)
    l1 = L1Store(4 * N, tenant_share_bytes=4 * N)
    for i in range(6):
        assert put(l1, A, i)
    assert held(l1, A, 6) == [2, 3, 4, 5]


def test_a_tenant_that_cannot_free_enough_of_its_own_evicts_nothing() -> None:
    l1 = L1Store(8 * N, tenant_share_bytes=2 * N)
    assert put(l1, A, 0) and put(l1, A, 1)
    assert len(l1.acquire_prefix([key(A, 1)])) == 1  # one of its two chunks is being read
    assert l1.reserve(2 * N, A) is None  # freeing chunk 0 alone would not make room
    assert held(l1, A, 2) == [0, 1] and by_label(l1)[label(A)] == (2 * N, 2, 1, 0)
    l1.release([key(A, 1)])
