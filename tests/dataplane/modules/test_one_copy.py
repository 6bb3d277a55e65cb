"""One-copy engine-driven transfers at the module seam: ENGINE_RESERVE / COMMIT / ACQUIRE / RELEASE.

The modules run in this process (`one_copy_support.Direct`), on a fake clock, over a real L1 arena
in shared memory. The worker's side maps that arena by the name ENGINE_REGISTER hands out, as a
worker does, and writes and reads the bytes there. What happens to open leases when their instance
goes, and the lease limit, are in `test_leases`; the client side is in
``tests/dataplane/client/test_one_copy.py``.

What L1 holds is read from its stats and from LOOKUP / ACQUIRE of another instance; whether a
chunk is still pinned, from whether L1 may evict it (a store under pressure, or ``clear``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from dataplane.memory import shm
from dataplane.wire.errors import NotOwner, RequestError
from dataplane.wire.replies import ArenaInfo, Released
from tests.dataplane.modules.one_copy_support import (
    CHUNK,
    OTHER,
    SLOT,
    Direct,
    DirectFactory,
    pattern,
    prompt,
    refused,
    tag,
)

# --------------------------------------------------------------------------- registration


def test_register_names_the_arena_when_it_is_shared(direct: Direct) -> None:
    seg = direct.l1.arena.segment
    assert seg is not None
    r = direct.register(1)
    assert r.arena == ArenaInfo(seg.name, seg.size, direct.l1.arena.growth()[0])
    assert (shm.SHM_DIR / seg.name).exists() and seg.size >= 8 * SLOT
    assert r.segment != seg.name  # the pool is a segment of its own
    again = direct.register(1)  # a repeat register (a refresh) names it too
    assert again.created is False and again.arena == r.arena


def test_a_private_arena_is_not_named_and_refuses_one_copy_transfers(make_direct: DirectFactory) -> None:
    d = make_direct(shared=False)
    assert d.l1.arena.segment is None
    r = d.register(1)
    assert r.arena is None and r.slot_bytes == SLOT
    attempts: list[Callable[[], object]] = [
        lambda: d.reserve(1, prompt(1, 2)),
        lambda: d.acquire(1, prompt(1, 2)),
    ]
    for attempt in attempts:
        with pytest.raises(RequestError, match="arena in shared memory") as exc:
            attempt()
        assert refused(exc.value)
    assert (d.used(), d.chunks()) == (0, 0)


# ----------------------------------------------------------------------- reserve / commit


def test_reserve_hands_out_buffers_only_for_missing_chunks_and_commit_publishes_them(direct: Direct) -> None:
    arena_bytes = direct.register(1).arena.bytes
    direct.register(2)  # the same model and layout: it shares the chunks
    tokens = prompt(1, 4)
    # L1 holds chunks 0 and 2 of the prompt
    for c in (0, 2):
        r = direct.reserve(1, tokens, c, 1)
        assert [idx for idx, _ in r.slots] == [0]
        direct.write(r, 1, first=c)
        assert direct.commit(1, r.lease) == 1
    held = {}
    for c in (0, 2):
        a = direct.acquire(2, tokens, c, 1)
        held[c] = a.offsets[0]
        direct.release(2, a.lease)
    assert (direct.used(), direct.chunks()) == (2 * SLOT, 2)

    r = direct.reserve(1, tokens)
    assert (r.chunks, r.present, r.rejected, r.slot_bytes) == (4, 2, 0, SLOT)
    assert [idx for idx, _ in r.slots] == [1, 3]  # only the chunks L1 does not hold
    spans = sorted([(off, off + SLOT) for _, off in r.slots] + [(o, o + SLOT) for o in held.values()])
    assert all(lo >= 0 and hi <= arena_bytes for lo, hi in spans)  # inside the arena
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # none overlaps another
    assert (direct.used(), direct.chunks()) == (4 * SLOT, 2)  # reserved: counted, not held
    direct.write(r, 1)

    # written but not committed: nobody sees chunks 1 and 3
    for iid in (1, 2):
        assert direct.lookup(iid, tokens) == CHUNK
    for first in (0, 1, 3):
        a = direct.acquire(2, tokens, first)
        assert len(a.offsets) == (1 if first == 0 else 0)
        direct.release(2, a.lease)

    assert direct.commit(1, r.lease) == 2
    assert direct.chunks() == 4 and direct.used() == 4 * SLOT
    for iid in (1, 2):
        assert direct.lookup(iid, tokens) == 4 * CHUNK
    a = direct.acquire(2, tokens)
    written = dict(r.slots)
    assert a.offsets == (held[0], written[1], held[2], written[3])
    for c, off in enumerate(a.offsets):
        assert torch.equal(direct.read(off), pattern(tag(1, c))), f"chunk {c}"
    direct.release(2, a.lease)

    # the lease is spent: a second COMMIT, and a RELEASE of a lease never given, are refused
    with pytest.raises(RequestError, match=f"lease {r.lease} is not open") as again:
        direct.commit(1, r.lease)
    assert refused(again.value)
    with pytest.raises(RequestError, match="lease 999 is not open") as unknown:
        direct.release(1, 999)
    assert refused(unknown.value)
    assert (direct.used(), direct.chunks(), direct.lookup(2, tokens)) == (4 * SLOT, 4, 4 * CHUNK)


def test_reserve_and_acquire_hash_no_chunk_past_the_last_asked_for(
    direct: Direct, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They may run on the loop thread that answers PING: a long prompt asked for one chunk
    costs one key, not one per chunk of the prompt."""
    from dataplane.modules import one_copy

    hashed: list[int] = []
    real = one_copy.chunk_keys

    def counting(scope: bytes, token_ids: np.ndarray, chunk_size: int, ctx: Any = None) -> list[bytes]:
        hashed.append(len(token_ids) // chunk_size)
        return real(scope, token_ids, chunk_size, ctx)

    monkeypatch.setattr(one_copy, "chunk_keys", counting)
    direct.register(1)
    direct.register(2)
    tokens = prompt(1, 200, extra=5)
    r = direct.reserve(1, tokens, 1, 1)
    assert [idx for idx, _ in r.slots] == [0] and r.chunks == 1
    direct.write(r, 1, first=1)
    assert direct.commit(1, r.lease) == 1
    a = direct.acquire(2, tokens, 1, 1)
    assert len(a.offsets) == 1
    assert bool((direct.read(a.offsets[0]) == pattern(tag(1, 1))).all())
    direct.release(2, a.lease)
    assert hashed == [2, 2]  # chunks 0 and 1 of 200
    with pytest.raises(RequestError, match="first_chunk \\+ n_chunks = 202 exceeds the 200 full chunks"):
        direct.reserve(1, tokens, 199, 3)


def test_a_released_reserve_lease_is_aborted(direct: Direct) -> None:
    direct.register(1)
    direct.register(2)
    assert direct.store(1, 1, 2) == 2
    before = direct.used()
    tokens = prompt(2, 3)
    r = direct.reserve(1, tokens)
    direct.write(r, 2)  # the worker wrote, then gives up
    assert direct.used() == before + 3 * SLOT
    assert direct.release(1, r.lease) == Released(True)
    assert (direct.used(), direct.chunks()) == (before, 2)  # the buffers went back
    assert direct.lookup(2, tokens) == 0 and direct.acquire(2, tokens).offsets == ()
    with pytest.raises(RequestError, match=f"lease {r.lease} is not open"):
        direct.commit(1, r.lease)
    # the chunks are still missing: the next reserve hands out buffers for all of them
    assert [idx for idx, _ in direct.reserve(1, tokens).slots] == [0, 1, 2]


# ------------------------------------------------------------------------ acquire / release


def test_acquire_pins_the_held_prefix_until_release(direct: Direct) -> None:
    direct.register(1)
    direct.register(2)
    a_tokens = prompt(1, 6)  # 4 chunks of it are stored: the held prefix is 4 long
    assert direct.acquire(2, a_tokens).offsets == ()
    assert direct.store(1, 1, 4) == 4
    acq = direct.acquire(2, a_tokens)
    assert len(acq.offsets) == 4 and acq.slot_bytes == SLOT

    # L1 (8 chunks) under pressure: a prompt of 8 gets only the 4 chunks the pins leave
    b = direct.reserve(1, prompt(2, 8))
    assert (len(b.slots), b.rejected) == (4, 4)
    assert not {off for _, off in b.slots} & set(acq.offsets)
    direct.write(b, 2)
    assert direct.commit(1, b.lease) == 4
    assert direct.lookup(1, a_tokens) == 4 * CHUNK  # nothing pinned was evicted, nor overwritten
    for c, off in enumerate(acq.offsets):
        assert torch.equal(direct.read(off), pattern(tag(1, c))), f"chunk {c}"

    assert direct.release(2, acq.lease) == Released(True)
    # unpinned: the next prompt of 8 evicts them all
    big = direct.reserve(1, prompt(3, 8))
    assert (len(big.slots), big.rejected) == (8, 0)
    assert direct.commit(1, big.lease) == 8
    assert direct.lookup(2, a_tokens) == 0


# ------------------------------------------------------------------------------ ownership


def test_a_wrong_secret_is_refused_on_every_one_copy_message_and_changes_nothing(direct: Direct) -> None:
    direct.register(1)
    direct.register(2)
    a_tokens, b_tokens = prompt(1, 2), prompt(2, 2)
    assert direct.store(1, 1, 2) == 2
    res = direct.reserve(1, b_tokens)
    direct.write(res, 2)
    acq = direct.acquire(1, a_tokens)
    direct.clock.advance(10)
    entry = direct.engine.registry.context_entry(1)
    assert entry is not None
    state = (direct.used(), direct.chunks(), direct.lookup(2, a_tokens), direct.lookup(2, b_tokens))
    assert state == (4 * SLOT, 2, 2 * CHUNK, 0)

    attempts: list[Callable[[], object]] = [
        lambda: direct.reserve(1, prompt(3, 2), secret=OTHER),
        lambda: direct.commit(1, res.lease, secret=OTHER),
        lambda: direct.acquire(1, a_tokens, secret=OTHER),
        lambda: direct.release(1, acq.lease, secret=OTHER),
        lambda: direct.release(1, res.lease, secret=OTHER),
    ]
    for attempt in attempts:
        with pytest.raises(NotOwner, match="instance 1 is registered by another owner"):
            attempt()
    assert (direct.used(), direct.chunks(), direct.lookup(2, a_tokens), direct.lookup(2, b_tokens)) == state
    assert direct.engine.registry.context_entry(1) == entry  # not even refreshed
    # the owner's leases are intact: its COMMIT publishes, its RELEASE lets go
    assert direct.commit(1, res.lease) == 2
    assert direct.release(1, acq.lease) == Released(True)
    assert direct.lookup(2, b_tokens) == 2 * CHUNK
    assert direct.l1.clear() == 4  # no pin left
