"""The leases of one-copy transfers at the module seam: what the release of their instance (an
UNREGISTER, a reap, an admin reap, a register of a new layout) does to open leases, leases built
while their instance is released, and the limit of MAX_LEASES per instance.

The modules run in this process (`one_copy_support.Direct`), on a fake clock, over a real L1 arena
in shared memory, as in `test_one_copy`. Whether a chunk is still pinned is read from whether L1
may evict it (a store under pressure, or ``clear``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from dataplane.modules.leases import MAX_LEASES
from dataplane.storage.l1.store import QUARANTINE_S, L1Store
from dataplane.wire.errors import LimitExceeded, NotRegistered, RequestError
from dataplane.wire.messages import Ping, Unregister
from dataplane.wire.replies import Unregistered
from tests.dataplane.modules.one_copy_support import (
    CHUNK,
    SLOT,
    TIMEOUT,
    Direct,
    DirectFactory,
    pattern,
    prompt,
    refused,
    tag,
)
from tests.dataplane.registration import SECRET

# -------------------------------------------------------------------- the instance's release


def _release_by_unregister(d: Direct) -> None:
    assert d.call(Unregister(1, SECRET), conn_fd=5) == Unregistered(True)


def _release_by_reap(d: Direct) -> None:
    assert d.call(Ping(1, SECRET)).tracked is True  # it spoke: the timeout applies to it
    d.clock.advance(TIMEOUT + 1)
    assert d.mgmt.reaper is not None
    assert d.mgmt.reaper.reap_once() == [1]  # instance 2, never pinged, is within its grace


def _release_by_admin(d: Direct) -> None:
    assert d.mgmt.force_reap(1) == ["engine_driven"]


def _release_by_new_layout(d: Direct) -> None:
    assert d.register(1, pool_chunks=8).created is True  # the old context is released


@pytest.mark.parametrize(
    "release",
    [_release_by_unregister, _release_by_reap, _release_by_admin, _release_by_new_layout],
    ids=["unregister", "reap", "admin-reap", "re-register"],
)
def test_the_instances_release_aborts_every_open_lease(
    make_direct: DirectFactory, release: Callable[[Direct], None]
) -> None:
    d = make_direct(slots=8)
    d.register(1)
    d.register(2)
    a_tokens, b_tokens = prompt(1, 2), prompt(2, 3)
    assert d.store(1, 1, 2) == 2
    acq = d.acquire(1, a_tokens)  # pins prompt 1
    assert len(acq.offsets) == 2
    res = d.reserve(1, b_tokens)  # buffers for prompt 2, half-written
    res_half = dataclasses.replace(res, slots=res.slots[:2])
    d.write(res_half, 2)
    assert (d.used(), d.chunks()) == (5 * SLOT, 2)

    release(d)

    # the reserved buffers are quarantined: the worker may still be writing into them
    assert (d.used(), d.chunks()) == (5 * SLOT, 2)
    d.clock.advance(QUARANTINE_S)
    d.l1.abort(d.l1.reserve(SLOT))
    assert d.used() == 5 * SLOT  # exactly the quarantine: not yet
    d.clock.advance(0.5)
    d.l1.abort(d.l1.reserve(SLOT))  # the next reserve ends the quarantine ...
    assert (d.used(), d.chunks()) == (2 * SLOT, 2)  # ... and the buffers are back
    assert d.lookup(2, b_tokens) == 0 and d.acquire(2, b_tokens).offsets == ()  # nothing published
    # neither lease is open any more: the instance is gone, or it is a new context
    for spent in (lambda: d.commit(1, res.lease), lambda: d.release(1, acq.lease)):
        with pytest.raises((NotRegistered, RequestError)) as exc:
            spent()
        assert isinstance(exc.value, NotRegistered) or refused(exc.value)
    # the pins went too: a prompt as big as L1 evicts prompt 1
    r = d.reserve(2, prompt(3, 8))
    assert (len(r.slots), r.rejected) == (8, 0)
    assert d.commit(2, r.lease) == 8
    assert d.lookup(2, a_tokens) == 0


@pytest.mark.parametrize("kind", ["reserve", "acquire"])
def test_a_lease_built_while_its_instance_is_released_is_refused_and_aborted(
    make_direct: DirectFactory, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Reserve and acquire do not hold the instance (they may run on the server loop): a
    release that lands while one builds its lease leaves no buffer reserved and no pin."""
    d = make_direct(slots=8)
    d.register(1)
    d.register(2)
    held = prompt(1, 2)
    assert d.store(2, 1, 2) == 2  # another instance's chunks, the prefix of the prompt below
    before = d.used()
    # the release lands between the lease's buffers and its being added (the reaper's thread
    # would: here the prefix pin, the last step before that, triggers it)
    real_pin = L1Store.pin_present if kind == "reserve" else L1Store.acquire_prefix

    def pin_then_release(self: L1Store, keys: list[bytes], *rest: Any) -> Any:
        out = real_pin(self, keys, *rest)
        monkeypatch.setattr(L1Store, real_pin.__name__, real_pin)
        _release_by_unregister(d)
        return out

    monkeypatch.setattr(L1Store, real_pin.__name__, pin_then_release)
    tokens = np.concatenate([held, prompt(3, 2)])
    with pytest.raises(NotRegistered, match="released while this request ran"):
        if kind == "reserve":
            d.reserve(1, tokens)
        else:
            d.acquire(1, tokens)
    assert (d.used(), d.chunks()) == (before, 2)  # no buffer kept, nothing published
    assert d.l1.clear() == 2  # and no pin left: both held chunks may go


# --------------------------------------------------------------------------- lease limit


def test_an_instance_holds_at_most_max_leases(make_direct: DirectFactory) -> None:
    d = make_direct(slots=32)
    d.register(1)
    d.register(2)
    a_tokens = prompt(1, 2)
    assert d.store(1, 1, 2) == 2
    reserves = [d.reserve(1, prompt(10 + i, 1)).lease for i in range(6)]  # a buffer each
    acquires = [d.acquire(1, a_tokens).lease for _ in range(MAX_LEASES - 6)]  # pins each
    used, chunks = d.used(), d.chunks()
    assert (used, chunks) == (8 * SLOT, 2)

    new = prompt(2, 3)
    attempts: list[Callable[[], object]] = [
        lambda: d.reserve(1, new),
        lambda: d.acquire(1, a_tokens),
        lambda: d.reserve(1, a_tokens),
    ]
    for attempt in attempts:
        with pytest.raises(LimitExceeded, match=f"{MAX_LEASES} leases are open"):
            attempt()
        assert (d.used(), d.chunks()) == (used, chunks)  # nothing reserved
    assert d.lookup(2, new) == 0
    # another instance has leases of its own
    other = d.acquire(2, a_tokens)
    d.release(2, other.lease)
    # one lease done: one more may open
    assert d.commit(1, reserves.pop()) == 1
    again = d.reserve(1, new)
    assert len(again.slots) == 3
    with pytest.raises(LimitExceeded):
        d.acquire(1, a_tokens)

    # let go of everything: then no pin is left (every chunk may be dropped) and no buffer
    d.release(1, again.lease)
    for lease in reserves:
        d.release(1, lease)
    for lease in acquires:
        d.release(1, lease)
    assert d.l1.clear() == 3 and (d.used(), d.chunks()) == (0, 0)


def test_a_reserve_refused_at_the_lease_limit_evicts_nothing(make_direct: DirectFactory) -> None:
    """A refused request changes nothing: not the chunks L1 holds either."""
    d = make_direct(slots=8)
    d.register(1)
    d.register(2)
    a_tokens = prompt(1, 8)
    assert d.store(1, 1, 8) == 8  # L1 is full of chunks nobody pins
    for _ in range(MAX_LEASES):
        d.acquire(2, prompt(2, 1))  # nothing held: a lease that holds nothing

    def state() -> tuple[int, int, int]:
        s = d.l1.stats()
        return s.chunks, s.evictions, s.used_bytes

    before = state()
    with pytest.raises(LimitExceeded):
        d.reserve(2, prompt(3, 4))
    assert state() == before
    assert d.lookup(1, a_tokens) == 8 * CHUNK


def test_the_buffers_of_an_aborted_lease_are_not_reused_under_a_live_workers_copy(direct: Direct) -> None:
    """The admin reaps instance 1 while its worker is copying into a reserve's buffers: the
    worker is alive and its copy goes on into the offsets it was given. Chunks another
    instance publishes meanwhile must not be where that copy lands."""
    direct.register(1)
    direct.register(2)
    late = direct.reserve(1, prompt(1, 2))
    assert direct.mgmt.force_reap(1) == ["engine_driven"]
    assert direct.store(2, 2, 2) == 2
    direct.write(late, 1)  # instance 1's worker finishes its copy
    acq = direct.acquire(2, prompt(2, 2))
    assert len(acq.offsets) == 2
    for c, off in enumerate(acq.offsets):
        assert torch.equal(direct.read(off), pattern(tag(2, c))), f"chunk {c} of instance 2 was overwritten"
