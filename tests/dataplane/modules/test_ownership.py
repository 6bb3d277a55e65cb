"""Protocol v2 at the module seam: instance ownership (secrets), for both transfer modules. A
register of a live id, or any request, with another secret is refused as NOT_OWNER and changes
nothing; the admin reap needs no secret.

The modules run in this process (`plane_support.Plane`), wired as ``build_dataplane`` wires them,
on a fake clock. Every registration maps real shared memory (`allocate_kv_caches`) or creates a
real chunk pool; what the server holds is read from /proc/self/maps and the segment directory,
never from the module. The instance quota and the byte budgets are in `test_limits`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dataplane.liveness.entry import Entry, InstanceInfo
from dataplane.liveness.quota import InstanceQuota
from dataplane.liveness.registry import LivenessRegistry
from dataplane.wire.errors import NotOwner
from dataplane.wire.messages import TransferMode
from dataplane.wire.replies import PingReply, Unregistered
from tests.dataplane.modules.plane_support import (
    CHUNK,
    ED,
    MODES,
    OTHER,
    SD,
    T0,
    Plane,
    PlaneFactory,
    budgeted,
    footprint,
    one_registration,
)
from tests.dataplane.registration import SECRET
from tests.helpers import FakeClock

# ----------------------------------------------------------------------------- ownership


@pytest.mark.parametrize("mode", MODES)
def test_a_register_of_a_live_id_with_another_secret_is_refused_and_touches_nothing(
    make_plane: PlaneFactory, mode: TransferMode
) -> None:
    # a budget with room for one registration only: the ownership check must come before any
    # work, so the stranger is refused as NOT_OWNER, never as over the budget
    plane, budget, _ = budgeted(make_plane, mode)
    first, held = plane.register(mode, 7, conn_fd=5)
    assert first.created is True and held.by_server()
    plane.clock.advance(10)
    before_entry, before = plane.entry(mode, 7), footprint()
    for layout in (0, 1):  # the owner's own layout, and another one
        with pytest.raises(NotOwner, match="instance 7 is registered by another owner") as refused:
            plane.register(mode, 7, secret=OTHER, conn_fd=6, layout=layout)
        # while the refusal is still held (as the loop holds it to reply): the stranger got
        # nothing mapped or created, and the owner's mapping (or pool) is the one it was
        assert footprint() == before and held.by_server(), refused.value
    # neither replaced nor refreshed: the entry, its last_seen and connection are the owner's
    assert plane.entry(mode, 7) == before_entry
    assert (before_entry.last_seen, before_entry.conn_fd) == (T0, 5)
    assert plane.tracked()[mode.value] == [7]
    assert budget.used == one_registration(mode)
    assert plane.quota is not None and plane.quota.tracked == 1
    # its layout is unchanged: the owner's repeat register still refreshes the same context
    again, same = plane.register(mode, 7, conn_fd=5)
    assert again.created is False and same == held
    assert plane.entry(mode, 7).last_seen == T0 + 10


@pytest.mark.parametrize("mode", MODES)
def test_the_owner_refreshes_and_may_register_a_new_layout(plane: Plane, mode: TransferMode) -> None:
    _, old = plane.register(mode, 7, conn_fd=5)
    plane.clock.advance(10)
    again, same = plane.register(mode, 7, conn_fd=6)
    assert again.created is False and same == old
    e = plane.entry(mode, 7)
    assert (e.registered_at, e.last_seen, e.conn_fd, e.has_liveness_signal) == (T0, T0 + 10, 6, False)
    plane.clock.advance(5)
    renewed, new = plane.register(mode, 7, conn_fd=6, layout=1)
    assert renewed.created is True and new != old
    assert new.by_server() and not old.by_server()
    assert plane.entry(mode, 7).registered_at == T0 + 15
    # the new context is still the owner's: a stranger is refused, the owner refreshes it
    with pytest.raises(NotOwner):
        plane.register(mode, 7, secret=OTHER, layout=1)
    assert plane.register(mode, 7, layout=1)[0].created is False


@pytest.mark.parametrize("mode", MODES)
def test_an_id_live_in_one_mode_cannot_be_taken_in_the_other_with_another_secret(
    make_plane: PlaneFactory, mode: TransferMode
) -> None:
    """The owner is known across modes (through the quota both registries share, as
    ``build_dataplane`` wires them)."""
    p = make_plane(quota=InstanceQuota(64, 64))
    other = ED if mode is SD else SD
    _, held = p.register(mode, 7)
    before = footprint()
    with pytest.raises(NotOwner, match="instance 7 is registered by another owner") as refused:
        p.register(other, 7, secret=OTHER, conn_fd=6, layout=1)
    assert footprint() == before and held.by_server(), refused.value
    assert p.tracked() == {mode.value: [7], other.value: []}
    assert p.ping(7, OTHER).tracked is False
    # the owner may register it in the other mode as well, and unregister it from both
    assert p.register(other, 7, layout=1)[0].created is True
    assert p.unregister(7, SECRET) == Unregistered(True)
    assert p.tracked() == {mode.value: [], other.value: []} and not held.by_server()
    # once it is gone the id is free: anyone may register it
    assert p.register(other, 7, secret=OTHER, layout=1)[0].created is True


def test_a_registry_put_over_another_owners_entry_is_refused(clock: FakeClock) -> None:
    """The registry's own guard (the handlers' check can be raced by a register slipping in
    between): a put over another secret's entry replaces nothing and takes no quota place."""
    released: list[tuple[int, str]] = []
    quota = InstanceQuota(2, 64)
    reg: LivenessRegistry[Entry] = LivenessRegistry(
        "r", lambda e, why: released.append((e.instance_id, why)), clock, quota=quota
    )
    info = InstanceInfo("server_driven", "shm", "m", 1, 0, 1, 2, "bfloat16")
    owner = Entry(7, clock(), clock(), b"scope", info, conn_fd=5, secret=SECRET)
    reg.put(owner, "replaced")
    clock.advance(3)
    with pytest.raises(NotOwner):
        reg.put(Entry(7, clock(), clock(), b"other", info, conn_fd=6, secret=OTHER), "replaced")
    e = reg.context_entry(7)
    assert e is not None and (e.registered_at, e.last_seen, e.conn_fd) == (T0, T0, 5)
    assert reg.scope_of(7, secret=SECRET) == b"scope"  # the owner's entry, not the stranger's
    assert released == [] and quota.tracked == 1
    with pytest.raises(NotOwner):
        reg.check_owner(7, OTHER)
    reg.check_owner(7, SECRET)
    reg.check_owner(404, OTHER)  # nobody owns an unknown id
    # the owner replaces its own entry: the old one is released
    reg.put(Entry(7, clock(), clock(), b"scope2", info, conn_fd=5, secret=SECRET), "replaced")
    assert released == [(7, "replaced")] and quota.tracked == 1
    renewed = reg.context_entry(7)
    assert renewed is not None and renewed.registered_at == T0 + 3
    assert reg.scope_of(7, secret=SECRET) == b"scope2"
    reg.close()
    assert quota.tracked == 0


@pytest.mark.parametrize("mode", MODES)
def test_requests_with_a_wrong_secret_are_refused_and_touch_nothing(plane: Plane, mode: TransferMode) -> None:
    _, held = plane.register(mode, 7, conn_fd=5)
    plane.clock.advance(10)
    registry = plane.registry(mode)
    before = plane.entry(mode, 7)
    refused: list[Callable[[], object]] = [
        lambda: plane.store(mode, 7, OTHER),
        lambda: plane.retrieve(mode, 7, OTHER),
        lambda: plane.lookup(7, OTHER),
        lambda: registry.scope_of(7, 9, OTHER),
    ]
    for attempt in refused:
        with pytest.raises(NotOwner, match="instance 7 is registered by another owner"):
            attempt()
    with pytest.raises(NotOwner), registry.use(7, 9, OTHER):
        pytest.fail("use() handed a wrong secret the entry")
    assert plane.entry(mode, 7) == before  # last_seen, connection: all as they were
    assert before.last_seen == T0 and before.conn_fd == 5
    assert held.by_server()
    # the refused STORE stored nothing; the owner's requests are served and refresh the entry
    assert plane.lookup(7, SECRET) == 0
    assert plane.store(mode, 7, SECRET).stored == 2
    assert plane.lookup(7, SECRET, conn_fd=11) == 2 * CHUNK
    assert registry.scope_of(7, 12, SECRET) is not None
    e = plane.entry(mode, 7)
    assert (e.last_seen, e.conn_fd, e.has_liveness_signal) == (T0 + 10, 12, False)
    # the refused use() left no user behind: an unregister releases at once, not "deferred"
    assert plane.unregister(7, SECRET) == Unregistered(True)
    assert not held.by_server()


@pytest.mark.parametrize("mode", MODES)
def test_a_touch_or_ping_with_a_wrong_secret_changes_nothing(plane: Plane, mode: TransferMode) -> None:
    plane.register(mode, 7, conn_fd=5)
    registry = plane.registry(mode)
    assert registry.mark_connection_closed(5, plane.clock()) == 1
    plane.clock.advance(10)
    before = plane.entry(mode, 7)
    assert (before.last_seen, before.has_liveness_signal, before.disconnected) == (T0, False, True)
    assert registry.touch_instance(7, 9, OTHER) is False
    assert plane.ping(7, OTHER) == PingReply(1, False)
    assert plane.entry(mode, 7) == before  # not refreshed, not latched, still disconnected
    # the owner's PING does all three
    assert plane.ping(7, SECRET, conn_fd=9) == PingReply(1, True)
    e = plane.entry(mode, 7)
    assert (e.last_seen, e.has_liveness_signal, e.disconnected, e.conn_fd) == (T0 + 10, True, False, 9)
    assert registry.touch_instance(7, 10, SECRET) is True


@pytest.mark.parametrize("mode", MODES)
def test_unregister_with_a_wrong_secret_is_refused_and_releases_nothing(
    plane: Plane, mode: TransferMode
) -> None:
    _, held = plane.register(mode, 7)
    plane.blend.state[7] = "rope-7"
    with pytest.raises(NotOwner):
        plane.unregister(7, OTHER, conn_fd=6)
    assert held.by_server() and plane.entry(mode, 7).instance_id == 7
    assert plane.blend.seen() == [] and plane.blend.state == {7: "rope-7"}  # no fan-out either
    assert plane.unregister(7, SECRET) == Unregistered(True)
    assert not held.by_server() and plane.registry(mode).context_entry(7) is None
    assert plane.blend.seen() == [7] and plane.blend.state == {}
    assert plane.mgmt.releaser.reaped_total == 0


def test_unregister_with_a_wrong_secret_releases_neither_mode(plane: Plane) -> None:
    _, mapped = plane.register(SD, 7)
    _, pool = plane.register(ED, 7)
    with pytest.raises(NotOwner):
        plane.unregister(7, OTHER)
    assert mapped.by_server() and pool.by_server()
    assert plane.tracked() == {SD.value: [7], ED.value: [7]}
    assert plane.unregister(7, SECRET) == Unregistered(True)
    assert not mapped.by_server() and not pool.by_server()
    assert plane.tracked() == {SD.value: [], ED.value: []}


def test_the_admin_reap_needs_no_secret(plane: Plane) -> None:
    _, mapped = plane.register(SD, 7)
    _, pool = plane.register(ED, 7)
    assert sorted(plane.mgmt.force_reap(7)) == [ED.value, SD.value]
    assert not mapped.by_server() and not pool.by_server()
    assert plane.tracked() == {SD.value: [], ED.value: []}
    assert plane.mgmt.releaser.reaped_total == 1
    value = plane.metrics.registry.get_sample_value("kvwarden_instances_reaped_total", {"reason": "admin"})
    assert value == 1
