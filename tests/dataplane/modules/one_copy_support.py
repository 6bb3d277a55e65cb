"""The in-process one-copy plane of the module tests (`test_one_copy`, `test_leases`): the modules
wired as ``build_dataplane`` wires them (the engine-driven module, the one-copy module on top of
it, LOOKUP, and the management module with the one release path), on a fake clock, over a real L1
arena in shared memory, and the worker's side of it. Its fixtures are in this directory's
``conftest.py``."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dataplane.liveness.release import InstanceReleaser
from dataplane.memory.shm import Segment
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext, ServerInfo
from dataplane.modules.engine_pool import EngineDrivenTransferModule
from dataplane.modules.lookup import LookupModule
from dataplane.modules.management import ManagementModule
from dataplane.modules.one_copy import DirectTransferModule
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1.arena import Arena
from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.errors import RequestError
from dataplane.wire.messages import (
    EngineAcquire,
    EngineCommit,
    EngineRelease,
    EngineReserve,
    Lookup,
    Message,
    MsgType,
)
from dataplane.wire.protocol import PROTOCOL_VERSION
from dataplane.wire.replies import Reserved
from tests.dataplane.registration import SECRET, engine_register_message
from tests.helpers import FakeClock

CHUNK = 16
# a chunk of the layout `engine_register_message` registers: 2 layers * K/V * CHUNK tokens *
# 2 heads * head dim 8 * bfloat16
SLOT = 2 * 2 * CHUNK * 2 * 8 * 2
T0 = 1000.0
TIMEOUT, GRACE = 120.0, 3600.0
OTHER = bytes(range(100, 116))  # not the registrant's secret


def prompt(p: int, chunks: int, extra: int = 0) -> np.ndarray:
    """Prompt ``p``: ``chunks`` full chunks (and ``extra`` tokens more); prompts never share a
    first token, so they share no chunk."""
    start = 10_000 * p
    return np.arange(start, start + chunks * CHUNK + extra, dtype=ID_DTYPE)


def pattern(tag: int, n: int = SLOT) -> torch.Tensor:
    """The bytes a test writes for one chunk: distinct per tag."""
    g = torch.Generator().manual_seed(tag)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def refused(exc: BaseException) -> bool:
    """A plain REQUEST_REFUSED (not one of its subclasses: NOT_OWNER, LIMIT_EXCEEDED, ...)."""
    return type(exc) is RequestError and exc.code == "REQUEST_REFUSED"


@dataclass
class Direct:
    """The modules of a data plane, in process, and one worker-side mapping of the arena."""

    clock: FakeClock
    l1: L1Store
    engine: EngineDrivenTransferModule
    mgmt: ManagementModule
    handlers: dict[MsgType, Handler]
    worker: Segment | None = None  # the arena, mapped as a worker maps it
    view: torch.Tensor | None = None
    rids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def call(self, msg: Message, conn_fd: int = 9) -> Any:
        rctx = RequestContext(next(self.rids), msg.TYPE, conn_fd)
        out: dict[str, Any] = self.handlers[msg.TYPE].fn(rctx, msg)
        return out

    def register(self, iid: int, secret: bytes = SECRET, pool_chunks: int = 4) -> Any:
        r = self.call(engine_register_message(iid, pool_chunks, secret=secret), conn_fd=5)
        if r.arena is not None and self.worker is None:
            self.worker = Segment.attach(r.arena.segment, r.arena.bytes, allow_sparse=True)
            self.view = self.worker.as_tensor()
        return r

    def reserve(
        self, iid: int, tokens: np.ndarray, first: int = 0, n: int | None = None, secret: bytes = SECRET
    ) -> Any:
        n = len(tokens) // CHUNK - first if n is None else n
        return self.call(EngineReserve(iid, secret, tokens, first, n))

    def commit(self, iid: int, lease: int, secret: bytes = SECRET) -> int:
        return int(self.call(EngineCommit(iid, secret, lease)).stored)

    def acquire(
        self, iid: int, tokens: np.ndarray, first: int = 0, n: int | None = None, secret: bytes = SECRET
    ) -> Any:
        n = len(tokens) // CHUNK - first if n is None else n
        return self.call(EngineAcquire(iid, secret, tokens, first, n))

    def release(self, iid: int, lease: int, secret: bytes = SECRET) -> Any:
        return self.call(EngineRelease(iid, secret, lease))

    def lookup(self, iid: int, tokens: np.ndarray, secret: bytes = SECRET) -> int:
        return int(self.call(Lookup(iid, secret, tokens)).hit_tokens)

    def arena(self) -> torch.Tensor:
        assert self.view is not None, "no instance was handed the arena"
        return self.view

    def write(self, r: Reserved, p: int, first: int = 0) -> None:
        """The worker's copies into a reserve's buffers: chunk c of prompt p gets pattern(tag)."""
        for idx, off in r.slots:
            self.arena()[off : off + r.slot_bytes] = pattern(tag(p, first + idx))

    def read(self, off: int) -> torch.Tensor:
        return self.arena()[off : off + SLOT].clone()

    def store(self, iid: int, p: int, chunks: int) -> int:
        """RESERVE, write and COMMIT the whole of prompt ``p``; the chunks stored."""
        r = self.reserve(iid, prompt(p, chunks))
        self.write(r, p)
        return self.commit(iid, r.lease)

    def used(self) -> int:
        return self.l1.stats().used_bytes

    def chunks(self) -> int:
        return self.l1.stats().chunks

    def close(self) -> None:
        self.engine.close()  # releases every instance, and with it every lease
        self.view = None
        if self.worker is not None:
            self.worker.close()
        self.l1.close()


def tag(p: int, c: int) -> int:
    return 1000 * p + c


DirectFactory = Callable[..., Direct]


def direct_planes() -> Iterator[DirectFactory]:
    """The body of the ``make_direct`` fixture: makes planes, and closes them after the test."""
    made: list[Direct] = []

    def make(shared: bool = True, slots: int = 8) -> Direct:
        clock, metrics = FakeClock(T0), DataPlaneMetrics()
        l1 = L1Store(slots * SLOT, arena=Arena(slots * SLOT, shared=shared, prefault=False), clock=clock)
        engine = EngineDrivenTransferModule(l1, CHUNK, metrics, clock)
        direct = DirectTransferModule(engine, l1, metrics)
        lookup = LookupModule(l1, CHUNK, metrics, [engine.registry])
        info = ServerInfo("test", 1, "test", PROTOCOL_VERSION, T0, "tcp://127.0.0.1:0", CHUNK, 16 << 20)
        mgmt = ManagementModule(
            info,
            InstanceReleaser([engine.registry], metrics),
            metrics,
            reap_timeout_s=TIMEOUT,
            registration_grace_s=GRACE,
            clock=clock,
        )
        handlers: dict[MsgType, Handler] = {}
        for m in (engine, direct, lookup, mgmt):
            handlers.update(m.handlers())
        d = Direct(clock, l1, engine, mgmt, handlers)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()
