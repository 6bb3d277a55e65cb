"""One-copy engine-driven transfers: ENGINE_RESERVE / COMMIT / ACQUIRE / RELEASE and their leases.

The first half runs the modules in this process, wired as ``build_dataplane`` wires them (the
engine-driven module, the one-copy module on top of it, LOOKUP, and the management module with
the one release path), on a fake clock, over a real L1 arena in shared memory. The worker's side
maps that arena by the name ENGINE_REGISTER hands out, as a worker does, and writes and reads
the bytes there. The second half runs a real data plane (`build_dataplane`) and real
engine-driven `WorkerAdapter`s.

What L1 holds is read from its stats and from LOOKUP / ACQUIRE of another instance; whether a
chunk is still pinned, from whether L1 may evict it (a store under pressure, or ``clear``).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from dataplane.client import WorkerAdapter
from dataplane.client.channel import Channel
from dataplane.client.one_copy import ArenaCopier
from dataplane.liveness.release import InstanceReleaser
from dataplane.memory import shm
from dataplane.memory.kvmemory import MappedKV, map_local_tensors
from dataplane.memory.shm import Segment
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext, ServerInfo
from dataplane.modules.engine_pool import EngineDrivenTransferModule
from dataplane.modules.leases import MAX_LEASES
from dataplane.modules.lookup import LookupModule
from dataplane.modules.management import ManagementModule
from dataplane.modules.one_copy import DirectTransferModule
from dataplane.server.config import Settings
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.storage import arena as arena_module
from dataplane.storage.arena import Arena
from dataplane.storage.l1 import QUARANTINE_S, L1Store
from dataplane.wire.checks import ID_DTYPE
from dataplane.wire.errors import LimitExceeded, NotOwner, NotRegistered, RequestError
from dataplane.wire.messages import (
    EngineAcquire,
    EngineCommit,
    EngineRegister,
    EngineRelease,
    EngineReserve,
    KVFormat,
    Lookup,
    Message,
    MsgType,
    Ping,
    Unregister,
)
from dataplane.wire.protocol import PROTOCOL_VERSION
from dataplane.wire.replies import ArenaInfo, Released, Reserved, StoreCounts, Unregistered
from tests.dataplane.registration import SECRET, engine_register_message
from tests.helpers import FakeClock, free_port, wait_until

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


# ------------------------------------------------------------------------ in-process plane


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


@pytest.fixture
def make_direct() -> Iterator[DirectFactory]:
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


@pytest.fixture
def direct(make_direct: DirectFactory) -> Direct:
    return make_direct()


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


# ---------------------------------------------------------------- through a real data plane

CS = 32  # the data plane's chunk size
LAYERS, BLOCKS, BS, HEADS, HD = 2, 256, 16, 2, 8
CB = LAYERS * 2 * CS * HEADS * HD * 2  # one chunk's bytes (bfloat16)
L1_CHUNKS = 80  # more than one RESERVE's 64 chunks


def settings() -> Settings:
    return Settings(
        port=free_port(), http_port=free_port(), chunk_size=CS, l1_size_gb=L1_CHUNKS * CB / (1 << 30)
    )


DpFactory = Callable[..., DataPlane]


@pytest.fixture
def make_dp(monkeypatch: pytest.MonkeyPatch) -> Iterator[DpFactory]:
    made: list[DataPlane] = []

    def make(private: bool = False, s: Settings | None = None) -> DataPlane:
        with monkeypatch.context() as m:
            if private:  # a segment directory without room for the arena: L1 is private memory
                m.setattr(arena_module, "_room_in", lambda _dir: 0)
            d = build_dataplane(s or settings())
        d.start()
        made.append(d)
        assert d.l1.arena.backing == ("private" if private else "shm")
        return d

    yield make
    for d in made:
        d.stop()


def caches(fill: bool) -> list[torch.Tensor]:
    out = [torch.zeros(2, BLOCKS, BS, HEADS, HD, dtype=torch.bfloat16) for _ in range(LAYERS)]
    if fill:
        for c in out:
            c.copy_(torch.randn(c.shape).to(c.dtype))
    return out


def tokens_of(kv: list[torch.Tensor], blocks: np.ndarray, n: int) -> list[torch.Tensor]:
    return [c[:, torch.from_numpy(blocks)].reshape(2, -1, HEADS, HD)[:, :n] for c in kv]


def same_tokens(a: list[torch.Tensor], ba: np.ndarray, b: list[torch.Tensor], bb: np.ndarray, n: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(tokens_of(a, ba, n), tokens_of(b, bb, n), strict=True))


def requests(dp: DataPlane, mtype: str, outcome: str = "ok") -> int:
    v = dp.metrics.registry.get_sample_value("kvwarden_requests_total", {"type": mtype, "outcome": outcome})
    return int(v or 0)


def stored_bytes(dp: DataPlane) -> int:
    v = dp.metrics.registry.get_sample_value("kvwarden_transfer_bytes_total", {"direction": "store"})
    return int(v or 0)


def adapter(dp: DataPlane, **kw: Any) -> WorkerAdapter:
    return WorkerAdapter(dp.server.bound_endpoint, "m", transfer_mode="engine_driven", **kw)


def test_worker_adapters_round_trip_through_the_shared_arena(make_dp: DpFactory) -> None:
    dp = make_dp()
    rng = np.random.default_rng(7)
    src, dst = caches(fill=True), caches(fill=False)
    tokens = rng.integers(0, 50_000, 7 * CS + 5)
    b_src, b_dst = rng.permutation(BLOCKS)[:15], rng.permutation(BLOCKS)[:15]
    a, b = adapter(dp), adapter(dp)
    try:
        a.register_kv_caches(src)
        first = tokens[: 5 * CS + 7]
        assert a.store_detail(first, b_src) == StoreCounts(5, 5, 0, 0, 0)
        # one copy: a RESERVE and a COMMIT; no pool, no LOOKUP first
        assert (requests(dp, "ENGINE_RESERVE"), requests(dp, "ENGINE_COMMIT")) == (1, 1)
        assert requests(dp, "ENGINE_STORE") == requests(dp, "LOOKUP") == 0
        assert dp.l1.stats().used_bytes == stored_bytes(dp) == 5 * CB
        # a repeat: all present, nothing copied twice
        assert a.store_detail(first, b_src) == StoreCounts(5, 0, 5, 0, 0)
        assert dp.l1.stats().used_bytes == stored_bytes(dp) == 5 * CB
        # a longer prompt: its prefix present, the rest stored
        assert a.store_detail(tokens, b_src) == StoreCounts(7, 2, 5, 0, 0)
        assert dp.l1.stats().used_bytes == stored_bytes(dp) == 7 * CB

        b.register_kv_caches(dst)
        assert b.lookup(tokens) == 7 * CS
        assert b.retrieve(tokens, b_dst) == 7 * CS
        assert same_tokens(src, b_src, dst, b_dst, 7 * CS)
        assert (requests(dp, "ENGINE_ACQUIRE"), requests(dp, "ENGINE_RELEASE")) == (1, 1)
        assert requests(dp, "ENGINE_RETRIEVE") == 0
    finally:
        a.close()
        b.close()
    assert dp.engine.registry.tracked_instance_count() == 0
    assert dp.l1.clear() == 7 and dp.l1.stats().used_bytes == 0  # no pin, no buffer left


def test_a_prompt_longer_than_l1_is_rejected_past_what_fits_and_keeps_its_prefix(make_dp: DpFactory) -> None:
    dp = make_dp()
    rng = np.random.default_rng(8)
    src, dst = caches(fill=True), caches(fill=False)
    n = 100  # chunks: two RESERVEs (64 + 36); L1 holds 80
    tokens = rng.integers(0, 50_000, n * CS)
    b_src, b_dst = rng.permutation(BLOCKS)[: n * CS // BS], rng.permutation(BLOCKS)[: n * CS // BS]
    a, b = adapter(dp), adapter(dp)
    try:
        a.register_kv_caches(src)
        r = a.store_detail(tokens, b_src)
        assert r == StoreCounts(n, L1_CHUNKS, 0, n - L1_CHUNKS, 0)
        assert requests(dp, "ENGINE_RESERVE") == requests(dp, "ENGINE_COMMIT") == 2
        assert not a.store(tokens, b_src)  # still does not fit: not all held
        b.register_kv_caches(dst)
        assert b.lookup(tokens) == L1_CHUNKS * CS  # the prefix, whole: the second half evicted none of it
        assert b.retrieve(tokens, b_dst) == L1_CHUNKS * CS
        assert same_tokens(src, b_src, dst, b_dst, L1_CHUNKS * CS)
    finally:
        a.close()
        b.close()
    assert dp.l1.clear() == L1_CHUNKS and dp.l1.stats().used_bytes == 0


def test_a_private_arena_worker_falls_back_to_the_pool(make_dp: DpFactory) -> None:
    dp = make_dp(private=True)
    rng = np.random.default_rng(9)
    src, dst = caches(fill=True), caches(fill=False)
    tokens = rng.integers(0, 50_000, 6 * CS + 3)
    b_src, b_dst = rng.permutation(BLOCKS)[:13], rng.permutation(BLOCKS)[:13]
    a, b = adapter(dp, pool_chunks=4), adapter(dp, pool_chunks=2)
    try:
        a.register_kv_caches(src)
        assert a.store_detail(tokens, b_src) == StoreCounts(6, 6, 0, 0, 0)
        assert a.store_detail(tokens, b_src).present == 6
        b.register_kv_caches(dst)
        assert b.retrieve(tokens, b_dst) == 6 * CS
        assert same_tokens(src, b_src, dst, b_dst, 6 * CS)
        assert requests(dp, "ENGINE_STORE") > 0 and requests(dp, "ENGINE_RETRIEVE") > 0
        for t in ("ENGINE_RESERVE", "ENGINE_COMMIT", "ENGINE_ACQUIRE", "ENGINE_RELEASE"):
            assert requests(dp, t) == requests(dp, t, "error") == 0, t
    finally:
        a.close()
        b.close()


class CopyFailed(RuntimeError):
    pass


@dataclass
class TornKV(MappedKV):
    """The worker's own cache, whose copy of every second chunk fails half-way (as a copy
    interrupted on the worker side would)."""

    calls: int = 0

    @classmethod
    def of(cls, kv: MappedKV) -> TornKV:
        return cls(**{f.name: getattr(kv, f.name) for f in dataclasses.fields(kv)})

    def gather(self, slots: np.ndarray, buf: torch.Tensor, splitter: Any = None) -> None:
        self.calls += 1
        if self.calls % 2 == 0:
            buf[: buf.numel() // 2].fill_(0xAB)
            raise CopyFailed("the worker's copy failed")
        super().gather(slots, buf, splitter)


def test_a_worker_side_failure_publishes_nothing_and_leaves_no_lease(make_dp: DpFactory) -> None:
    dp = make_dp()
    rng = np.random.default_rng(10)
    src = caches(fill=True)
    tokens = rng.integers(0, 50_000, 3 * CS)
    blocks = rng.permutation(BLOCKS)[:6]
    b = adapter(dp)
    a = adapter(dp)
    ctx: zmq.Context[Any] = zmq.Context()
    chan = Channel(ctx, dp.server.bound_endpoint)
    seg: Segment | None = None
    copier: ArenaCopier | None = None
    try:
        b.register_kv_caches(caches(fill=False))
        # through the adapter: a block outside the cache fails on the worker side (its
        # blocks are checked before any RESERVE)
        a.register_kv_caches(src)
        with pytest.raises(ValueError, match="outside the registered cache"):
            a.store(tokens, np.array([*blocks[:5], BLOCKS]))
        assert b.lookup(tokens) == 0 and dp.l1.stats().used_bytes == 0

        # the worker side of the one-copy path (what the adapter runs), its copy failing
        # between RESERVE and COMMIT: after the first chunk is written, in the second
        iid, secret = 77, bytes(range(50, 66))
        reg = EngineRegister(
            iid, secret, "m", 1, 0, "bfloat16", LAYERS, HEADS, HD, 1, os.getpid(), KVFormat.TOKEN_MAJOR, 16
        )
        arena = chan.request(reg, 10.0).arena
        seg = Segment.attach(arena.segment, arena.bytes, allow_sparse=True)
        copier = ArenaCopier(iid, secret, seg.as_tensor(), int(arena.usable))

        def send(m: Message) -> Any:
            return chan.request(m, 10.0)

        torn = TornKV.of(map_local_tensors(src))
        for _ in range(MAX_LEASES + 1):  # a lease left open by each would refuse the last ones
            with pytest.raises(CopyFailed):
                copier.store(send, torn, tokens, blocks, CS)
        assert requests(dp, "ENGINE_RESERVE") == requests(dp, "ENGINE_RELEASE") == MAX_LEASES + 1
        assert requests(dp, "ENGINE_COMMIT") == requests(dp, "ENGINE_RESERVE", "error") == 0
        assert dp.l1.stats().used_bytes == 0 and dp.l1.stats().chunks == 0
        assert b.lookup(tokens) == 0

        # the copy mended, the same prompt goes in whole and round-trips
        done = copier.store(send, map_local_tensors(src), tokens, blocks, CS)
        assert done == StoreCounts(3, 3, 0, 0, 0)
        dst = caches(fill=False)
        b2 = adapter(dp)
        try:
            b2.register_kv_caches(dst)
            assert b2.retrieve(tokens, blocks[::-1].copy()) == 3 * CS
            assert same_tokens(src, blocks, dst, blocks[::-1].copy(), 3 * CS)
        finally:
            b2.close()
    finally:
        if copier is not None:
            copier.close()
        if seg is not None:
            seg.close()
        chan.close()
        ctx.term()
        a.close()
        b.close()


def test_a_worker_re_registered_with_a_private_arena_server_stops_using_the_old_arena(
    make_dp: DpFactory,
) -> None:
    """The server restarts (same endpoint) with L1 in private memory: the worker's
    re-register names no arena, so its transfers must go through the pool again."""
    s = settings()
    first = make_dp(s=s)
    rng = np.random.default_rng(11)
    src, dst = caches(fill=True), caches(fill=False)
    tokens = rng.integers(0, 50_000, 3 * CS)
    blocks = rng.permutation(BLOCKS)[:6]
    a = adapter(first, heartbeat_interval=0.2)
    b: WorkerAdapter | None = None
    try:
        a.register_kv_caches(src)
        assert a.store(tokens, blocks)
        first.stop()
        second = make_dp(private=True, s=s)
        wait_until(lambda: a.registrations == 2 and a.is_healthy, 15, what="the re-register")
        assert a.store_detail(tokens, blocks) == StoreCounts(3, 3, 0, 0, 0)
        b = adapter(second)
        b.register_kv_caches(dst)
        assert b.retrieve(tokens, blocks) == 3 * CS
        assert same_tokens(src, blocks, dst, blocks, 3 * CS)
    finally:
        a.close()
        if b is not None:
            b.close()


@dataclass
class Stalling(MappedKV):
    """The worker's own cache; before its first copy, ``stall`` runs (what happens to the
    server meanwhile)."""

    stall: Callable[[], None] | None = None

    def gather(self, slots: np.ndarray, buf: torch.Tensor, splitter: Any = None) -> None:
        stall, self.stall = self.stall, None
        if stall is not None:
            stall()
        super().gather(slots, buf, splitter)


def test_a_store_whose_lease_is_aborted_by_a_reap_and_re_register_is_no_error(make_dp: DpFactory) -> None:
    """The admin reaps the instance between RESERVE and COMMIT and the worker's heartbeat
    re-registers it at once: the store is a miss (or stores), never an error raised to the
    engine (the pool path stores in that case)."""
    dp = make_dp()
    rng = np.random.default_rng(12)
    tokens = rng.integers(0, 50_000, 3 * CS)
    blocks = rng.permutation(BLOCKS)[:6]
    a, b = adapter(dp, heartbeat_interval=0.2), adapter(dp)
    try:
        a.register_kv_caches(caches(fill=True))
        b.register_kv_caches(caches(fill=False))

        def reap_and_re_register() -> None:
            assert dp.force_reap(a.instance_id) == ["engine_driven"]
            wait_until(lambda: a.registrations == 2, 10, what="the heartbeat's re-register")

        # (the seam: the adapter's copy of its own cache)
        local = a._transport._local  # type: ignore[attr-defined]
        fields = {f.name: getattr(local, f.name) for f in dataclasses.fields(local)}
        a._transport._local = Stalling(**fields, stall=reap_and_re_register)  # type: ignore[attr-defined]
        r = a.store_detail(tokens, blocks)
        assert (r.stored + r.present) * CS <= b.lookup(tokens)  # nothing claimed that is not held
        assert a.store_detail(tokens, blocks).rejected == 0
        assert b.lookup(tokens) == 3 * CS
    finally:
        a.close()
        b.close()
