"""Protocol v2 at the module seam: the instance quota (max_instances, per connection) and the byte
budgets (mapped worker memory, chunk pools), for both transfer modules. A refusal is
LIMIT_EXCEEDED naming the setting, and leaves nothing mapped or created; places and bytes come
back once the holder goes.

The modules run in this process (`plane_support.Plane`), wired as ``build_dataplane`` wires them
(one quota shared by both registries), on a fake clock. What the server holds is read from
/proc/self/maps and the segment directory, never from the module. Ownership is in
`test_ownership`.
"""

from __future__ import annotations

import pytest

from dataplane.liveness.quota import InstanceQuota
from dataplane.memory.budget import ByteBudget
from dataplane.wire.errors import LimitExceeded, NotOwner
from dataplane.wire.messages import TransferMode
from dataplane.wire.replies import Unregistered
from tests.dataplane.modules.plane_support import (
    CACHE_BYTES,
    ED,
    GRACE,
    MODES,
    OTHER,
    SD,
    TIMEOUT,
    PlaneFactory,
    budgeted,
    footprint,
    maps_count,
    one_registration,
    second_layout,
)
from tests.dataplane.registration import SECRET, segment_of

# ---------------------------------------------------------------------------------- quota


def test_max_instances_refuses_a_new_id_until_a_place_is_free(make_plane: PlaneFactory) -> None:
    p = make_plane(quota=InstanceQuota(2, 64))
    p.register(SD, 1)
    p.register(ED, 2)  # one quota for both modes
    for mode in MODES:
        with pytest.raises(LimitExceeded, match=r"max_instances 2\)"):
            p.register(mode, 3)
    # a tracked id is no new instance: repeat registers and a new layout still go through
    assert p.register(SD, 1)[0].created is False
    assert p.register(SD, 1, layout=1)[0].created is True
    assert p.register(ED, 2)[0].created is False
    assert p.quota is not None and p.quota.tracked == 2
    assert p.tracked() == {SD.value: [1], ED.value: [2]}
    # an UNREGISTER gives its place back ...
    assert p.unregister(1, SECRET) == Unregistered(True)
    assert p.register(SD, 3)[0].created is True
    with pytest.raises(LimitExceeded, match="max_instances"):
        p.register(ED, 4)
    # ... and so does a reap: 2 pinged once and went silent past the timeout, 3 stays fresh
    assert p.registry(ED).touch_instance(2, secret=SECRET)
    p.clock.advance(TIMEOUT + 1)
    assert p.reap() == [2]
    assert p.register(ED, 4)[0].created is True
    assert p.quota.tracked == 2
    assert p.tracked() == {SD.value: [3], ED.value: [4]}


def test_max_instances_per_connection_counts_the_registering_connection(make_plane: PlaneFactory) -> None:
    quota = InstanceQuota(100, 2)
    p = make_plane(quota=quota)
    p.register(SD, 1, conn_fd=5)
    p.register(ED, 2, conn_fd=5)
    for mode in MODES:
        with pytest.raises(LimitExceeded, match=r"max_instances_per_connection 2\)"):
            p.register(mode, 3, conn_fd=5)
    assert p.register(SD, 1, conn_fd=5)[0].created is False  # a tracked id: still fine
    assert p.register(SD, 3, conn_fd=6)[0].created is True  # another connection has room
    quota.on_connection(5, True)  # a connect resets nothing
    with pytest.raises(LimitExceeded, match="max_instances_per_connection"):
        p.register(ED, 4, conn_fd=5)
    quota.on_connection(5, False)  # that connection closed: its count starts again
    p.register(ED, 4, conn_fd=5)
    p.register(SD, 5, conn_fd=5)
    with pytest.raises(LimitExceeded, match="max_instances_per_connection"):
        p.register(SD, 6, conn_fd=5)
    # an instance that goes gives its connection's place back
    assert p.unregister(4, SECRET) == Unregistered(True)
    assert p.register(SD, 6, conn_fd=5)[0].created is True
    assert quota.tracked == 5
    assert p.tracked() == {SD.value: [1, 3, 5, 6], ED.value: [2]}


def test_an_id_registered_in_both_modes_takes_one_place(make_plane: PlaneFactory) -> None:
    quota = InstanceQuota(1, 1)
    p = make_plane(quota=quota)
    assert p.register(SD, 7, conn_fd=5)[0].created is True
    assert p.register(ED, 7, conn_fd=5)[0].created is True
    assert quota.tracked == 1
    for mode in MODES:
        with pytest.raises(LimitExceeded, match="max_instances"):
            p.register(mode, 8, conn_fd=6)
    assert p.unregister(7, SECRET) == Unregistered(True)
    assert quota.tracked == 0
    assert p.register(ED, 8, conn_fd=5)[0].created is True


def test_an_id_one_mode_lets_go_stays_counted_and_owned_while_the_other_holds_it(
    make_plane: PlaneFactory,
) -> None:
    quota = InstanceQuota(2, 64)
    p = make_plane(quota=quota)
    clock = p.clock
    p.register(SD, 7, conn_fd=5)
    p.register(ED, 7, conn_fd=5)
    p.registry(ED).touch_instance(7)
    clock.advance(TIMEOUT + 1)
    p.registry(SD).touch_instance(7)  # only the server-driven entry keeps speaking
    assert [r.instance_id for r in p.registry(ED).reap_stale_instances(TIMEOUT, GRACE)] == [7]
    assert p.registry(SD).context_entry(7) is not None
    assert quota.tracked == 1  # still held: still counted ...
    with pytest.raises(NotOwner):  # ... and still owned, in either mode
        p.register(ED, 7, conn_fd=6, secret=OTHER)
    p.register(SD, 8, conn_fd=6)  # the second place
    with pytest.raises(LimitExceeded, match="max_instances"):
        p.register(ED, 9, conn_fd=6)


@pytest.mark.parametrize("mode", MODES)
def test_a_register_the_quota_refuses_leaves_nothing_mapped_or_created(
    make_plane: PlaneFactory, mode: TransferMode
) -> None:
    mapped = ByteBudget("worker memory mapped", 1 << 30, "max_mapped_gb")
    pools = ByteBudget("the chunk pools", 1 << 30, "max_pool_gb")
    p = make_plane(quota=InstanceQuota(1, 64), mapped_budget=mapped, pool_budget=pools)
    _, held = p.register(SD, 1)
    used, before = (mapped.used, pools.used), footprint()
    assert used == (CACHE_BYTES, 0)
    with pytest.raises(LimitExceeded, match="max_instances") as refused:
        p.register(mode, 2, layout=1)
    # checked while the refusal is still held (as the loop holds it to reply): no mapping of
    # the other caches, no pool segment
    assert footprint() == before, refused.value
    if mode is SD:
        assert maps_count(segment_of(p.caches[1])) == 1  # the worker's own mapping only
    assert (mapped.used, pools.used) == used  # the budgets got their bytes back
    assert held.by_server() and p.tracked() == {SD.value: [1], ED.value: []}


# -------------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("mode", MODES)
def test_a_registration_past_the_budget_is_refused_until_the_holder_is_unregistered(
    make_plane: PlaneFactory, mode: TransferMode
) -> None:
    p, budget, setting = budgeted(make_plane, mode)
    _, first = p.register(mode, 1)
    assert budget.used == one_registration(mode)
    before = footprint()
    with pytest.raises(LimitExceeded, match=setting) as refused:
        p.register(mode, 2, layout=second_layout(mode))
    assert footprint() == before and budget.used == one_registration(mode), refused.value
    assert p.quota is not None and p.quota.tracked == 1  # the refused id took no place
    assert p.tracked()[mode.value] == [1]
    assert p.unregister(1, SECRET) == Unregistered(True)
    assert not first.by_server() and budget.used == 0
    _, second = p.register(mode, 2, layout=second_layout(mode))
    assert second.by_server() and budget.used == one_registration(mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_reap_gives_the_budget_back(make_plane: PlaneFactory, mode: TransferMode) -> None:
    p, budget, setting = budgeted(make_plane, mode)
    _, first = p.register(mode, 1)
    p.clock.advance(GRACE + 1)  # never pinged: past the registration grace
    with pytest.raises(LimitExceeded, match=setting):
        p.register(mode, 2, layout=second_layout(mode))
    assert p.reap() == [1]
    assert not first.by_server() and budget.used == 0
    assert p.register(mode, 2, layout=second_layout(mode))[0].created is True
    assert budget.used == one_registration(mode)


@pytest.mark.parametrize("mode", MODES)
def test_the_budget_comes_back_only_when_the_transfer_holding_it_ends(
    make_plane: PlaneFactory, mode: TransferMode
) -> None:
    p, budget, setting = budgeted(make_plane, mode)
    _, first = p.register(mode, 1)
    assert p.registry(mode).touch_instance(1, secret=SECRET)
    with p.registry(mode).use(1, secret=SECRET):  # a transfer is copying
        p.clock.advance(TIMEOUT + 1)
        assert p.reap() == [1]
        assert p.tracked()[mode.value] == []
        # its memory is still in use: still held, still counted
        assert first.by_server() and budget.used == one_registration(mode)
        with pytest.raises(LimitExceeded, match=setting):
            p.register(mode, 2, layout=second_layout(mode))
    assert not first.by_server() and budget.used == 0
    assert p.register(mode, 2, layout=second_layout(mode))[0].created is True
