"""Lookups see stores in flight: a one-copy reserve's chunks are pending until committed (a
partial commit publishes the first ones), and end with an abort, an expired lease or the
request's connection closing; LOOKUP_WAITED reports land in /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from dataplane.modules.base import RequestContext
from dataplane.modules.leases import LEASE_TTL_S, Lease, Leases, reserve_into
from dataplane.wire.errors import NotRegistered
from dataplane.wire.messages import EngineCommit, Lookup, LookupWaited, MsgType
from dataplane.wire.replies import Hits
from tests.dataplane.modules.one_copy_support import CHUNK, SLOT, Direct, prompt
from tests.dataplane.registration import SECRET

IID, OTHER_IID = 11, 12


def hits(d: Direct, iid: int, tokens: object) -> tuple[int, int]:
    r: Hits = d.call(Lookup(iid, SECRET, tokens))  # type: ignore[arg-type]
    return r.hit_tokens, r.pending_tokens


def test_a_reserve_is_pending_for_every_worker_until_committed_part_by_part(direct: Direct) -> None:
    direct.register(IID)
    direct.register(OTHER_IID)
    p = prompt(1, 6)
    assert hits(direct, OTHER_IID, p) == (0, 0)
    r = direct.reserve(IID, p)
    assert hits(direct, OTHER_IID, p) == (0, 6 * CHUNK)  # another worker sees them coming
    assert hits(direct, OTHER_IID, p[: 2 * CHUNK + 3]) == (0, 2 * CHUNK)  # within what it asks
    direct.write(r, 1)
    assert direct.call(EngineCommit(IID, SECRET, r.lease, 2)).stored == 2
    assert hits(direct, OTHER_IID, p) == (2 * CHUNK, 4 * CHUNK)
    assert direct.call(EngineCommit(IID, SECRET, r.lease, 3)).stored == 3
    assert hits(direct, OTHER_IID, p) == (5 * CHUNK, CHUNK)
    assert direct.commit(IID, r.lease) == 1  # the rest, and the lease closes
    assert hits(direct, OTHER_IID, p) == (6 * CHUNK, 0)
    assert direct.l1.inflight.stores() == 0 and direct.used() == 6 * SLOT


def test_pending_follows_the_held_prefix_and_ends_with_a_release(direct: Direct) -> None:
    direct.register(IID)
    assert direct.store(IID, 2, 2) == 2
    r = direct.reserve(IID, prompt(2, 5))  # the first two are held: three are handed out
    assert len(r.slots) == 3 and hits(direct, IID, prompt(2, 5)) == (2 * CHUNK, 3 * CHUNK)
    direct.release(IID, r.lease)  # a release aborts a reserve: nothing more is coming
    assert hits(direct, IID, prompt(2, 5)) == (2 * CHUNK, 0) and direct.used() == 2 * SLOT


def test_a_closed_connection_ends_its_stores_at_once_and_a_late_commit_still_publishes(
    direct: Direct,
) -> None:
    direct.register(IID)
    r = direct.reserve(IID, prompt(3, 4))  # over connection 9 (`Direct.call`)
    direct.write(r, 3)
    direct.l1.inflight.on_connection(9, False)  # the loop saw it close: its worker is gone
    assert hits(direct, IID, prompt(3, 4)) == (0, 0)
    assert direct.commit(IID, r.lease) == 4  # a reconnected worker's commit is still good
    assert hits(direct, IID, prompt(3, 4)) == (4 * CHUNK, 0)


def test_an_expired_lease_is_no_longer_pending(direct: Direct) -> None:
    leases = Leases(clock=direct.clock)
    lease = Lease()
    reserve_into(lease, direct.l1, [bytes([i]) * 16 for i in range(3)], SLOT, conn_fd=9)
    leases.add(lease)
    assert direct.l1.inflight.chunks() == 3
    direct.clock.advance(LEASE_TTL_S + 1)
    leases.room(direct.l1)  # the next lease expires the stale one first
    assert direct.l1.inflight.chunks() == 0 and direct.l1.inflight.stores() == 0


def test_a_partial_commit_after_the_instance_went_publishes_nothing_more(direct: Direct) -> None:
    direct.register(IID)
    r = direct.reserve(IID, prompt(6, 4))
    direct.write(r, 6)
    lease = direct.engine.registry.touch(IID, 9, SECRET).leases.take(r.lease)
    direct.engine.registry.touch(IID, 9, SECRET).leases.abort_all(direct.l1)  # the instance goes
    assert lease.commit(direct.l1, 2) == 2  # what a commit already running publishes
    with pytest.raises(NotRegistered):
        direct.engine.registry.touch(IID, 9, SECRET).leases.put_back(r.lease, lease, direct.l1)
    assert hits(direct, IID, prompt(6, 4)) == (2 * CHUNK, 0) and direct.l1.inflight.stores() == 0
    assert direct.used() == 4 * SLOT  # two published, two out of use (its worker may still write)


def test_lookup_waited_reports_are_counted_by_outcome(direct: Direct) -> None:
    handler = direct.handlers[MsgType.LOOKUP_WAITED]
    for waited, outcome in ((0.004, "hit"), (0.03, "hit"), (1.0, "gave_up"), (0.2, "partial")):
        rctx = RequestContext(1, MsgType.LOOKUP_WAITED, 9)
        assert handler.fn(rctx, LookupWaited(waited, outcome)).counted is True
    text = generate_latest(direct.engine.metrics.registry).decode()
    assert 'kvwarden_lookup_waits_total{outcome="hit"} 2.0' in text
    assert 'kvwarden_lookup_waits_total{outcome="gave_up"} 1.0' in text
    assert 'kvwarden_lookup_waits_total{outcome="partial"} 1.0' in text
    assert "kvwarden_lookup_wait_seconds_count 4.0" in text
    assert "kvwarden_lookup_wait_seconds_sum 1.234" in text


def test_a_server_side_copy_is_pending_chunk_by_chunk_as_it_lands(direct: Direct) -> None:
    keys = [bytes([i]) * 16 for i in range(4)]
    seen: list[tuple[int, int]] = []

    def fill(i: int, buf: object) -> None:  # what a lookup sees while chunk i is copied
        held = direct.l1.prefix_hits(keys)
        seen.append((held, direct.l1.inflight.run(keys[held:])))

    counts = direct.engine.write_chunks(IID, keys, SLOT, fill, conn_fd=9)
    assert counts.stored == 4 and seen == [(0, 4), (1, 3), (2, 2), (3, 1)]
    assert direct.l1.inflight.stores() == 0
