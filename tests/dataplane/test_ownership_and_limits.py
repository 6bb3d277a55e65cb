"""Protocol v2 at the module seam: instance ownership (secrets), the instance quota and the byte
budgets, for both transfer modules.

The modules run in this process, wired as ``build_dataplane`` wires them (one quota shared by
both registries, the one release path under the management module), on a fake clock. Every
registration maps real shared memory (`allocate_kv_caches`) or creates a real chunk pool; what the
server holds is read from /proc/self/maps and the segment directory, never from the module.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from dataplane.liveness.entry import Entry, InstanceInfo
from dataplane.liveness.quota import InstanceQuota
from dataplane.liveness.registry import LivenessRegistry
from dataplane.liveness.release import InstanceReleaser
from dataplane.memory import shm
from dataplane.memory.budget import ByteBudget
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import RequestContext, ServerInfo
from dataplane.modules.engine_pool import EngineDrivenTransferModule
from dataplane.modules.lookup import LookupModule
from dataplane.modules.management import ManagementModule
from dataplane.modules.server_driven import ServerDrivenTransferModule
from dataplane.storage.l1 import L1Store
from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.errors import LimitExceeded, NotOwner
from dataplane.wire.messages import (
    EngineRetrieve,
    EngineStore,
    Lookup,
    Message,
    Ping,
    Retrieve,
    Store,
    TransferMode,
    Unregister,
)
from dataplane.wire.protocol import PROTOCOL_VERSION
from dataplane.wire.replies import PingReply, Unregistered
from tests.dataplane.fakes import BlendLike
from tests.dataplane.registration import SECRET, engine_register_message, register_message, segment_of
from tests.helpers import FakeClock

CHUNK = 16
T0 = 1000.0
TIMEOUT, GRACE = 120.0, 3600.0
OTHER = bytes(range(100, 116))  # a second registrant's secret
SD, ED = TransferMode.SERVER_DRIVEN, TransferMode.ENGINE_DRIVEN
MODES = [SD, ED]
# the caches of `make_caches`: 2 layers of [2, 16 blocks, 16 tokens, 2 heads, 8] bfloat16
CACHE_BYTES = 2 * (2 * 16 * 16 * 2 * 8) * 2
# an engine-driven pool slot: 2 layers * K/V * CHUNK tokens * 2 heads * 8 * bfloat16
SLOT_BYTES = 2 * 2 * CHUNK * 2 * 8 * 2
POOL_CHUNKS = 4  # the pool of layout 0; layout n has POOL_CHUNKS * (n + 1) slots
TOKENS = np.arange(300, 300 + 2 * CHUNK, dtype=ID_DTYPE)  # two full chunks
_SEGMENT = re.compile(r"kvwarden-\d+-[0-9a-f]{16}")

Caches = list[torch.Tensor]


# ------------------------------------------------------------------------ observations


def maps_count(name: str) -> int:
    with open("/proc/self/maps") as f:
        return f.read().count(name)


def footprint() -> tuple[Counter[str], frozenset[str]]:
    """Every kvwarden segment mapped in this process (with how often), and every segment file
    this process created (the worker's caches and the server's pools)."""
    with open("/proc/self/maps") as f:
        mapped = Counter(_SEGMENT.findall(f.read()))
    mine = f"{shm.PREFIX}{os.getpid()}-"
    files = frozenset(p.name for p in shm.SHM_DIR.iterdir() if p.name.startswith((mine, ".kvwarden-")))
    return mapped, files


@dataclass(frozen=True)
class Held:
    """What one registration made the server hold: a mapping of the worker's segment
    (server-driven) or a pool segment the server created (engine-driven)."""

    mode: TransferMode
    segment: str

    def by_server(self) -> bool:
        """True: the server maps it (and a pool exists); False: the server let all of it go."""
        n = maps_count(self.segment)
        if self.mode is SD:  # the worker side of this process maps it once, the server once more
            assert n in (1, 2), n
            return n == 2
        exists = (shm.SHM_DIR / self.segment).exists()
        assert (n == 1) == exists, (n, exists)  # a pool is mapped exactly while it exists
        return exists


# ----------------------------------------------------------------------------- the plane


@dataclass
class Plane:
    """Both transfer modules, the lookup and management modules, one release path."""

    clock: FakeClock
    caches: list[Caches]
    sd: ServerDrivenTransferModule
    ed: EngineDrivenTransferModule
    lookup_module: LookupModule
    mgmt: ManagementModule
    blend: BlendLike
    quota: InstanceQuota | None
    metrics: DataPlaneMetrics
    rids: Iterator[int] = field(default_factory=lambda: iter(range(1, 1 << 30)))

    def module(self, mode: TransferMode) -> ServerDrivenTransferModule | EngineDrivenTransferModule:
        return self.sd if mode is SD else self.ed

    def registry(self, mode: TransferMode) -> LivenessRegistry[Any]:
        return self.module(mode).registry

    def _call(self, handlers: Any, msg: Message, conn_fd: int) -> dict[str, Any]:
        out: dict[str, Any] = handlers[msg.TYPE].fn(RequestContext(next(self.rids), msg.TYPE, conn_fd), msg)
        return out

    def register(
        self, mode: TransferMode, iid: int, *, secret: bytes = SECRET, conn_fd: int = 5, layout: int = 0
    ) -> tuple[dict[str, Any], Held]:
        """REGISTER (or ENGINE_REGISTER) ``iid``; ``layout`` picks one of several layouts."""
        if mode is SD:
            caches = self.caches[layout]
            out = self._call(self.sd.handlers(), register_message(iid, caches, secret=secret), conn_fd)
            return out, Held(SD, segment_of(caches))
        msg = engine_register_message(iid, POOL_CHUNKS * (layout + 1), secret=secret)
        out = self._call(self.ed.handlers(), msg, conn_fd)
        return out, Held(ED, out.segment)

    def store(self, mode: TransferMode, iid: int, secret: bytes, conn_fd: int = 9) -> dict[str, Any]:
        msg: Message
        if mode is SD:
            msg = Store(iid, secret, TOKENS, np.array([0, 1], dtype=ID_DTYPE))
        else:
            msg = EngineStore(iid, secret, TOKENS, 0, 2)
        return self._call(self.module(mode).handlers(), msg, conn_fd)

    def retrieve(self, mode: TransferMode, iid: int, secret: bytes, conn_fd: int = 9) -> dict[str, Any]:
        msg: Message
        if mode is SD:
            msg = Retrieve(iid, secret, TOKENS, np.array([2, 3], dtype=ID_DTYPE))
        else:
            msg = EngineRetrieve(iid, secret, TOKENS, 0, 2)
        return self._call(self.module(mode).handlers(), msg, conn_fd)

    def lookup(self, iid: int, secret: bytes, conn_fd: int = 9) -> int:
        out = self._call(self.lookup_module.handlers(), Lookup(iid, secret, TOKENS), conn_fd)
        return int(out.hit_tokens)

    def unregister(self, iid: int, secret: bytes, conn_fd: int = 5) -> dict[str, Any]:
        return self._call(self.mgmt.handlers(), Unregister(iid, secret), conn_fd)

    def ping(self, iid: int, secret: bytes, conn_fd: int = 9) -> dict[str, Any]:
        return self._call(self.mgmt.handlers(), Ping(iid, secret), conn_fd)

    def reap(self) -> list[int]:
        """One step of the management module's reaper (its thread is never started)."""
        assert self.mgmt.reaper is not None
        return sorted(self.mgmt.reaper.reap_once())

    def entry(self, mode: TransferMode, iid: int) -> Any:
        e = self.registry(mode).context_entry(iid)
        assert e is not None, f"instance {iid} is not tracked in {mode.value}"
        return e

    def tracked(self) -> dict[str, list[int]]:
        return {
            m.value: sorted(e.instance_id for e in self.registry(m).context_entries_snapshot()) for m in MODES
        }


PlaneFactory = Callable[..., Plane]


@pytest.fixture
def make_plane(make_caches: Callable[[], Caches]) -> Iterator[PlaneFactory]:
    made: list[Plane] = []

    def make(
        quota: InstanceQuota | None = None,
        mapped_budget: ByteBudget | None = None,
        pool_budget: ByteBudget | None = None,
    ) -> Plane:
        clock, metrics, l1 = FakeClock(T0), DataPlaneMetrics(), L1Store(8 << 20)
        sd = ServerDrivenTransferModule(l1, CHUNK, metrics, clock, quota=quota, mapped_budget=mapped_budget)
        ed = EngineDrivenTransferModule(l1, CHUNK, metrics, clock, quota=quota, pool_budget=pool_budget)
        blend = BlendLike()
        info = ServerInfo("test", 1, "test", PROTOCOL_VERSION, T0, "tcp://127.0.0.1:0", CHUNK, 16 << 20)
        mgmt = ManagementModule(
            info,
            InstanceReleaser([sd.registry, ed.registry, blend], metrics),
            metrics,
            reap_timeout_s=TIMEOUT,
            registration_grace_s=GRACE,
            clock=clock,
        )
        lookup = LookupModule(l1, CHUNK, metrics, [sd.registry, ed.registry])
        p = Plane(clock, [make_caches(), make_caches()], sd, ed, lookup, mgmt, blend, quota, metrics)
        made.append(p)
        return p

    yield make
    for p in made:
        p.sd.close()
        p.ed.close()


@pytest.fixture
def plane(make_plane: PlaneFactory) -> Plane:
    return make_plane()


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


def budgeted(make_plane: PlaneFactory, mode: TransferMode) -> tuple[Plane, ByteBudget, str]:
    """A plane whose ``mode`` budget holds one registration of layout 0, not two."""
    if mode is SD:
        budget = ByteBudget("worker memory mapped", CACHE_BYTES * 3 // 2, "max_mapped_gb")
        return make_plane(quota=InstanceQuota(64, 64), mapped_budget=budget), budget, "--max-mapped-gb"
    budget = ByteBudget("the chunk pools", POOL_CHUNKS * SLOT_BYTES * 3 // 2, "max_pool_gb")
    return make_plane(quota=InstanceQuota(64, 64), pool_budget=budget), budget, "--max-pool-gb"


def second_layout(mode: TransferMode) -> int:
    """The layout of a second instance: other caches (server-driven), the same pool size."""
    return 1 if mode is SD else 0


def one_registration(mode: TransferMode) -> int:
    return CACHE_BYTES if mode is SD else POOL_CHUNKS * SLOT_BYTES


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
