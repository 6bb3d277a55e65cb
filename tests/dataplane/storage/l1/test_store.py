"""L1: LRU order, exact byte accounting, pinning, duplicate commits, clear."""

from __future__ import annotations

import random

import pytest
import torch

from dataplane.storage.l1 import L1Store

N = 1024  # bytes per chunk in these tests


def missing(l1: L1Store, keys: list[bytes]) -> list[int]:
    """Indexes of ``keys`` L1 does not hold (through pin_present, pins let go at once)."""
    absent, held = l1.pin_present(keys)
    l1.release(held)
    return absent


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(l1: L1Store, i: int, nbytes: int = N) -> torch.Tensor:
    buf = l1.reserve(nbytes)
    assert buf is not None, f"reserve for chunk {i} refused"
    assert buf.numel() == nbytes and buf.dtype == torch.uint8
    buf.fill_(i % 251)
    assert l1.commit(key(i), buf)
    return buf


def present(l1: L1Store, *ids: int) -> list[bool]:
    absent = set(missing(l1, [key(i) for i in ids]))
    return [n not in absent for n in range(len(ids))]


def check_accounting(l1: L1Store) -> None:
    s = l1.stats()
    assert 0 <= s.used_bytes <= s.capacity_bytes


def test_rejects_non_positive_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        L1Store(0)
    with pytest.raises(ValueError, match="capacity"):
        L1Store(-5)


def test_store_and_read_back() -> None:
    l1 = L1Store(4 * N)
    put(l1, 1)
    put(l1, 2)
    bufs = l1.acquire_prefix([key(1), key(2), key(3)])
    assert len(bufs) == 2
    assert int(bufs[0][0]) == 1 and int(bufs[1][-1]) == 2
    l1.release([key(1), key(2)])
    s = l1.stats()
    assert (s.used_bytes, s.chunks, s.evictions) == (2 * N, 2, 0)
    assert s.hits == 2  # what a reader found, not what it asked for
    assert l1.prefix_hits([key(1)]) == 1 and l1.stats().hits == 2  # (a lookup is not a read)


def test_prefix_stops_at_first_gap() -> None:
    l1 = L1Store(4 * N)
    put(l1, 1)
    put(l1, 3)
    assert l1.prefix_hits([key(1), key(2), key(3)]) == 1
    assert l1.prefix_hits([key(2), key(3)]) == 0
    assert len(l1.acquire_prefix([key(2), key(3)])) == 0
    assert missing(l1, [key(1), key(2), key(3)]) == [1]


def test_lru_eviction_order() -> None:
    l1 = L1Store(3 * N)
    for i in (1, 2, 3):
        put(l1, i)
    put(l1, 4)  # evicts 1, the oldest
    assert present(l1, 1, 2, 3, 4) == [False, True, True, True]
    assert l1.prefix_hits([key(2)]) == 1  # a hit refreshes 2: 3 is now the oldest
    put(l1, 5)
    assert present(l1, 2, 3, 4, 5) == [True, False, True, True]
    l1.release(l1.acquire_prefix([key(4)]))  # reading refreshes too: 2 is now the oldest
    l1.release([key(4)])
    put(l1, 6)
    assert present(l1, 2, 4, 5, 6) == [False, True, True, True]
    assert l1.stats().evictions == 3
    assert l1.stats().chunks == 3
    check_accounting(l1)


def test_evicted_buffer_is_reused() -> None:
    l1 = L1Store(2 * N)
    a = put(l1, 1)
    put(l1, 2)
    c = l1.reserve(N)
    assert c is not None
    assert c.data_ptr() == a.data_ptr()  # chunk 1's buffer, recycled without an allocation
    assert l1.stats().used_bytes == 2 * N


def test_pinned_chunk_is_not_evicted() -> None:
    l1 = L1Store(3 * N)
    for i in (1, 2, 3):
        put(l1, i)
    held = l1.acquire_prefix([key(1)])  # 1 is the oldest but pinned
    assert len(held) == 1
    l1.prefix_hits([key(2), key(3)])  # make sure pinning, not recency, protects 1
    put(l1, 4)
    assert present(l1, 1, 2, 3, 4) == [True, False, True, True]
    assert int(held[0][0]) == 1  # the reader's bytes were not recycled under it
    l1.release([key(1)])
    l1.prefix_hits([key(3), key(4)])
    put(l1, 5)  # once released, 1 is evictable again
    assert present(l1, 1, 3, 4, 5) == [False, True, True, True]
    check_accounting(l1)


def test_pins_are_counted() -> None:
    l1 = L1Store(2 * N)
    put(l1, 1)
    put(l1, 2)
    l1.acquire_prefix([key(1)])
    l1.acquire_prefix([key(1)])
    l1.release([key(1)])
    l1.prefix_hits([key(2)])
    put(l1, 3)  # 1 still has a reader: 2 goes
    assert present(l1, 1, 2, 3) == [True, False, True]
    l1.release([key(1)])
    l1.release([key(1)])  # an extra release does not underflow
    l1.prefix_hits([key(3)])
    put(l1, 4)
    assert present(l1, 1, 3, 4) == [False, True, True]


def test_reserve_returns_none_when_everything_is_pinned() -> None:
    l1 = L1Store(3 * N)
    for i in (1, 2, 3):
        put(l1, i)
    keys = [key(1), key(2), key(3)]
    assert len(l1.acquire_prefix(keys)) == 3
    before = l1.stats()
    assert l1.reserve(N) is None
    after = l1.stats()
    assert after.rejected == before.rejected + 1
    assert after.used_bytes == before.used_bytes == 3 * N
    assert after.chunks == 3 and after.evictions == 0
    l1.release(keys)
    assert l1.reserve(N) is not None


def test_reserved_but_uncommitted_bytes_count() -> None:
    l1 = L1Store(2 * N)
    a = l1.reserve(N)
    b = l1.reserve(N)
    assert a is not None and b is not None
    assert l1.stats().used_bytes == 2 * N
    assert l1.reserve(N) is None  # nothing committed, nothing evictable
    l1.abort(a)
    s = l1.stats()
    assert s.used_bytes == N
    c = l1.reserve(N)
    assert c is not None and c.data_ptr() == a.data_ptr()
    check_accounting(l1)


def test_commit_of_duplicate_key_returns_false_and_recycles() -> None:
    l1 = L1Store(4 * N)
    first = put(l1, 1)
    dup = l1.reserve(N)
    assert dup is not None
    dup.fill_(99)
    assert l1.stats().used_bytes == 2 * N
    assert l1.commit(key(1), dup) is False
    s = l1.stats()
    assert (s.used_bytes, s.chunks) == (N, 1)
    got = l1.acquire_prefix([key(1)])
    assert got[0].data_ptr() == first.data_ptr()  # the first copy stays
    assert int(got[0][0]) == 1
    l1.release([key(1)])
    again = l1.reserve(N)
    assert again is not None and again.data_ptr() == dup.data_ptr()  # recycled
    check_accounting(l1)


def test_different_sizes_share_capacity() -> None:
    l1 = L1Store(4 * N)
    put(l1, 1, N)
    put(l1, 2, N)
    put(l1, 3, 2 * N)
    assert l1.stats().used_bytes == 4 * N
    put(l1, 4, 2 * N)  # evicts 1 and 2: their neighbouring extents coalesce into one
    assert present(l1, 1, 2, 3, 4) == [False, False, True, True]
    s = l1.stats()
    assert s.used_bytes == 4 * N and s.fragmentation == 0.0
    check_accounting(l1)


def test_clear() -> None:
    l1 = L1Store(4 * N)
    for i in (1, 2, 3):
        put(l1, i)
    dup = l1.reserve(N)
    assert dup is not None
    l1.abort(dup)  # its bytes go back to the arena
    assert l1.stats().used_bytes == 3 * N
    l1.acquire_prefix([key(2)])
    assert l1.clear() == 2
    s = l1.stats()
    assert (s.chunks, s.used_bytes) == (1, N)
    assert present(l1, 1, 2, 3) == [False, True, False]
    l1.release([key(2)])
    assert l1.clear() == 1
    assert l1.stats().used_bytes == 0 and l1.stats().chunks == 0


def test_clear_keeps_reserved_bytes_counted() -> None:
    l1 = L1Store(2 * N)
    pending = l1.reserve(N)
    assert pending is not None
    assert l1.clear() == 0
    assert l1.stats().used_bytes == N
    assert l1.commit(key(1), pending)
    assert l1.stats().chunks == 1


def test_oversized_reserve_does_not_flush_the_cache() -> None:
    """A chunk that can never fit is refused without evicting what is stored."""
    l1 = L1Store(4 * N)
    for i in (1, 2, 3):
        put(l1, i)
    assert l1.reserve(5 * N) is None
    assert present(l1, 1, 2, 3) == [True, True, True]
    assert l1.stats().evictions == 0


def test_accounting_holds_under_random_operations() -> None:
    rng = random.Random(1234)
    cap = 16 * N
    l1 = L1Store(cap)
    sizes = (N, 2 * N, 3 * N)
    committed: dict[bytes, int] = {}
    pending: list[torch.Tensor] = []
    pinned: list[bytes] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.45:
            buf = l1.reserve(rng.choice(sizes))
            if buf is not None:
                pending.append(buf)
        elif op < 0.75 and pending:
            buf = pending.pop(rng.randrange(len(pending)))
            k = key(rng.randrange(40))
            if l1.commit(k, buf):
                committed[k] = buf.numel()
        elif op < 0.8 and pending:
            l1.abort(pending.pop())
        elif op < 0.88:
            k = key(rng.randrange(40))
            if l1.acquire_prefix([k]):
                pinned.append(k)
        elif op < 0.96 and pinned:
            l1.release([pinned.pop(rng.randrange(len(pinned)))])
        elif op < 0.97:
            l1.clear()
        else:
            l1.prefix_hits([key(rng.randrange(40))])
        # chunks gone from L1 are gone from our model too
        live = set(committed) - {key(i) for i in range(40) if missing(l1, [key(i)])}
        committed = {k: committed[k] for k in live}
        for k in pinned:
            assert not missing(l1, [k]), f"step {step}: a pinned chunk was dropped"
        s = l1.stats()
        assert s.used_bytes == sum(committed.values()) + sum(b.numel() for b in pending), step
        assert s.used_bytes <= cap, step
        assert s.chunks == len(committed), step
