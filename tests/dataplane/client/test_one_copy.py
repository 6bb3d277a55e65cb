"""One-copy engine-driven transfers through the client: a real data plane (`build_dataplane`)
and real engine-driven `WorkerAdapter`s (dataplane/client/one_copy.py: the worker's copies into
the server's shared arena, between ENGINE_RESERVE and ENGINE_COMMIT, and out of it after
ENGINE_ACQUIRE). The module seam is tested in ``tests/dataplane/modules/test_one_copy.py``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from dataplane.client import WorkerAdapter
from dataplane.client.channel import Channel
from dataplane.client.one_copy import ArenaCopier
from dataplane.memory.kvmemory import MappedKV, map_local_tensors
from dataplane.memory.shm import Segment
from dataplane.modules.leases import MAX_LEASES
from dataplane.server.config import Settings
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.storage.l1 import arena as arena_module
from dataplane.wire.messages import EngineRegister, KVFormat, Message
from dataplane.wire.replies import StoreCounts
from tests.helpers import free_port, wait_until

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
