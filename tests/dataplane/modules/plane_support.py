"""The plane of the ownership and limit tests (`test_ownership`, `test_limits`): both transfer
modules, the lookup and management modules, wired as ``build_dataplane`` wires them (one quota
shared by both registries, the one release path under the management module), on a fake clock,
and what a registration made the server hold, read from /proc/self/maps and the segment directory.
Its fixtures are in this directory's ``conftest.py``."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

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
    this process created (the worker's caches and the server's pools). A segment still being
    created (``.kvwarden-creating-...``) names no process: another test's, on another worker,
    may be there at any moment, so those are left out."""
    with open("/proc/self/maps") as f:
        mapped = Counter(_SEGMENT.findall(f.read()))
    mine = f"{shm.PREFIX}{os.getpid()}-"
    files = frozenset(p.name for p in shm.SHM_DIR.iterdir() if p.name.startswith(mine))
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


def planes(make_caches: Callable[[], Caches]) -> Iterator[PlaneFactory]:
    """The body of the ``make_plane`` fixture: makes planes, and closes them after the test."""
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
