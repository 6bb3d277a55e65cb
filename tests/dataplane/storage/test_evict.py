"""LFUDA's order: reads outweigh recency, ageing lets old favourites go, pinned chunks are passed
over and kept in place, and a chunk gone from L1 is never named."""

from __future__ import annotations

import random

import pytest

from dataplane.storage.evict import GHOST_PER_CHUNK, MAX_READS, LFUDAOrder
from dataplane.storage.l1 import L1Store

N = 1024


def k(i: int) -> bytes:
    return i.to_bytes(4, "little")


def test_a_chunk_read_more_often_outlives_more_recent_ones() -> None:
    o = LFUDAOrder()
    for i in range(3):
        o.added(k(i))
    o.used(k(0), read=True)  # 0: two reads' worth; 1 and 2: one each, 2 the most recent
    assert o.victim(lambda _: True) == k(1)  # equal worth: the least recently used first
    assert o.age == 1.0
    assert o.victim(lambda _: True) == k(2)
    assert o.victim(lambda _: True) == k(0) and o.age == 2.0
    assert o.victim(lambda _: True) is None and len(o) == 0


def test_a_lookup_refreshes_without_counting_a_read() -> None:
    o = LFUDAOrder()
    o.added(k(0))
    o.added(k(1))
    o.used(k(0), read=False)  # the same worth as 1, used later
    assert o.victim(lambda _: True) == k(1)


def test_ageing_lets_an_old_favourite_go_to_chunks_used_since() -> None:
    o = LFUDAOrder()
    o.added(k(0))
    for _ in range(10):
        o.used(k(0), read=True)  # worth MAX_READS at age 0, however often it is read
    assert MAX_READS == 4
    n = 1
    while True:  # a stream of chunks each read once: every eviction raises the age
        o.added(k(n))
        o.used(k(n), read=True)
        gone = o.victim(lambda _: True)
        if gone == k(0):
            break
        assert gone is not None
        n += 1
    assert 2 <= n <= 4 and o.age == 4.0  # it went once the others' worth (age + 2) passed its own


def test_a_chunk_stored_again_comes_back_with_the_reads_it_had() -> None:
    o = LFUDAOrder()
    o.added(k(0))
    o.used(k(0), read=True)  # worth 2
    assert o.victim(lambda _: True) == k(0) and o.age == 2.0
    o.added(k(1))  # worth age + 1
    o.added(k(0))  # back: its 2 and this store
    assert o.victim(lambda _: True) == k(1)
    for i in range(2, 200):  # what is remembered stays within its bound
        o.added(k(i))
        o.removed(k(i))
    assert len(o._ghost) <= GHOST_PER_CHUNK * max(1, len(o))


def test_pinned_chunks_are_passed_over_and_keep_their_place() -> None:
    o = LFUDAOrder()
    for i in range(4):
        o.added(k(i))
    pinned = {k(0), k(1)}
    assert o.victim(lambda key: key not in pinned) == k(2)
    assert o.victim(lambda key: key not in pinned) == k(3)
    assert o.victim(lambda key: key not in pinned) is None
    assert o.victim(lambda _: True) == k(0)  # still first once let go


def test_a_removed_chunk_is_never_named_and_the_heap_stays_bounded() -> None:
    o = LFUDAOrder()
    o.added(k(0))
    o.added(k(1))
    o.removed(k(0))
    o.used(k(0), read=True)  # (a use of a chunk L1 no longer holds: ignored)
    for _ in range(5000):
        o.used(k(1), read=False)
    assert len(o._heap) <= 2 * len(o) + 1024
    assert o.victim(lambda _: True) == k(1) and o.victim(lambda _: True) is None


def put(l1: L1Store, i: int) -> None:
    buf = l1.reserve(N)
    assert buf is not None
    assert l1.commit(k(i), buf)


def test_l1_with_lfuda_keeps_a_read_chunk_through_a_burst_lru_would_lose_it_to() -> None:
    for policy, kept in (("lru", False), ("lfuda", True)):
        l1 = L1Store(4 * N, policy=policy)
        put(l1, 0)
        for _ in range(3):
            assert len(l1.acquire_prefix([k(0)])) == 1
            l1.release([k(0)])
        for i in range(1, 5):  # four new chunks, each read once: L1 holds four
            put(l1, i)
            assert len(l1.acquire_prefix([k(i)])) == 1
            l1.release([k(i)])
        absent, held = l1.pin_present([k(0)])
        l1.release(held)
        assert (absent == []) is kept, policy
        assert l1.stats().policy == policy and l1.stats().evictions == 1


def test_lfuda_keeps_exact_accounting_and_never_drops_a_pinned_chunk() -> None:
    with pytest.raises(ValueError, match="eviction policy 'fifo': one of lru, lfuda"):
        L1Store(N, policy="fifo")
    rng = random.Random(7)
    l1 = L1Store(8 * N, policy="lfuda")
    pinned: set[int] = set()
    committed: set[int] = set()
    for _ in range(3000):
        i = rng.randrange(30)
        op = rng.random()
        if op < 0.5:
            buf = l1.reserve(N)
            if buf is None:
                assert len(pinned) == 8  # refused only when every chunk is pinned
                continue
            if l1.commit(k(i), buf):
                committed.add(i)
        elif op < 0.7 and i not in pinned:
            if l1.acquire_prefix([k(i)]):
                pinned.add(i)
        elif op < 0.85 and pinned:
            j = rng.choice(sorted(pinned))
            l1.release([k(j)])
            pinned.discard(j)
        else:
            l1.prefix_hits([k(i)])
        absent, held = l1.pin_present([k(j) for j in range(30)])
        l1.release(held)
        live = {j for j in range(30) if j not in absent}
        assert pinned <= live
        s = l1.stats()
        assert s.chunks == len(live) and s.used_bytes == len(live) * N <= 8 * N
