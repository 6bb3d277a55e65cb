"""L1's clear of a scope (`clear_scope`, `begin_clear` / `end_clear`): the scope's chunks go and
are announced, others stay; nothing produced before the clear commits after it; pinned chunks
are waited for, within the deadline."""

from __future__ import annotations

import threading

import pytest

from dataplane.events.sink import EventSink
from dataplane.events.vllm_format import MEDIUM_CPU
from dataplane.storage.keys import ScopeMatch
from dataplane.storage.l1 import L1Store
from tests.helpers import wait_until

N = 1024
A, B = b"A" * 16, b"B" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(l1: L1Store, i: int, scope: bytes) -> None:
    buf = l1.reserve(N)
    assert buf is not None
    buf.fill_(i % 251)
    assert l1.commit(key(i), buf, scope=scope)


def held(l1: L1Store, *ids: int) -> list[bool]:
    return [l1.peek_prefix([key(i)]) == 1 for i in ids]


def test_a_clear_drops_its_scope_alone_and_announces_each_chunk() -> None:
    l1 = L1Store(16 * N)
    l1.events = sink = EventSink()
    for i in range(3):
        put(l1, i, A)
    for i in range(3, 5):
        put(l1, i, B)
    sink.take(100)
    got = l1.clear_scope(ScopeMatch(A))
    assert (got.l1, got.pinned, got.complete, got.removed) == (3, 0, True, 3)
    assert held(l1, 0, 1, 2, 3, 4) == [False, False, False, True, True]
    assert l1.stats().used_bytes == 2 * N and l1.stats().chunks == 2
    assert sorted(sink.take(100)) == sorted(("removed", key(i), MEDIUM_CPU) for i in range(3))
    assert l1.clear_scope(ScopeMatch(A)).l1 == 0  # nothing left of it
    with pytest.raises(ValueError, match="names a scope"):
        l1.clear_scope(ScopeMatch(b""))


def test_bytes_reserved_before_a_clear_never_commit_after_it() -> None:
    l1 = L1Store(16 * N)
    early = l1.reserve(N)  # a STORE of the old weights' KV, under way when the clear comes
    other = l1.reserve(N)
    assert early is not None and other is not None
    l1.clear_scope(ScopeMatch(A))
    assert not l1.commit(key(1), early, scope=A)  # refused: stale
    assert l1.commit(key(2), other, scope=B)  # another scope's is not
    assert held(l1, 1, 2) == [False, True] and l1.stats().used_bytes == N
    late = l1.reserve(N)  # after the clear: new KV commits
    assert late is not None and l1.commit(key(1), late, scope=A)
    assert held(l1, 1) == [True] and l1.stats().used_bytes == 2 * N


def test_a_lower_tiers_read_begun_before_a_clear_never_enters_after_it() -> None:
    l1 = L1Store(16 * N)
    since = l1.epoch()  # a read from the file or remote tier starts
    l1.begin_clear(ScopeMatch(A))
    buf = l1.reserve(N)  # its buffer, asked for once the size is known: during the clear
    assert buf is not None
    assert not l1.commit(key(1), buf, scope=A)  # while the clear runs: refused
    assert l1.end_clear(ScopeMatch(A), 1.0) == (0, 0)
    buf = l1.reserve(N)
    assert buf is not None
    assert not l1.commit(key(1), buf, scope=A, since=since)  # read before the clear: refused
    buf = l1.reserve(N)
    assert buf is not None
    assert l1.commit(key(1), buf, scope=A, since=l1.epoch())  # read after it: taken
    assert l1.stats().used_bytes == N and l1.stats().chunks == 1


def test_a_clear_waits_for_the_readers_of_its_chunks_within_its_deadline() -> None:
    l1 = L1Store(16 * N)
    put(l1, 1, A)
    put(l1, 2, A)
    assert len(l1.acquire_prefix([key(1)])) == 1  # a copy out under way
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(l1.clear_scope(ScopeMatch(A), wait_s=30.0)))
    t.start()
    wait_until(lambda: not held(l1, 2)[0], 10, what="the unpinned chunk dropped at once")
    assert held(l1, 1) == [True] and t.is_alive()  # the pinned one is waited for
    l1.release([key(1)])
    t.join(10)
    assert not t.is_alive()
    (got,) = out
    assert got.l1 == 2 and got.complete  # type: ignore[attr-defined]
    assert l1.stats().used_bytes == 0
    put(l1, 3, A)
    assert len(l1.acquire_prefix([key(3)])) == 1  # a reader that never lets go
    stuck = l1.clear_scope(ScopeMatch(A), wait_s=0.05)
    assert (stuck.l1, stuck.pinned, stuck.complete) == (0, 1, False)
    l1.release([key(3)])
    assert l1.clear_scope(ScopeMatch(A)).l1 == 1
