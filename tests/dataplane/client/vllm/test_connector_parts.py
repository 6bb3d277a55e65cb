"""The vLLM connector's parts that need no vLLM, against a real server where they talk to one:
vLLM's CPU block layout moved whole (``vllm_cpu``), multi-head latent attention's one latent a
token, keyed once for every rank (``latent``), LOOKUP_SCOPE, the scheduler's planning, the
worker's registration that waits for a server, its stores off the step, its loads that name
the blocks they could not fill, and the connector's settings."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import zmq

from dataplane.client import WorkerAdapter
from dataplane.client.vllm.lookup import Scope, ScopeLookup
from dataplane.client.vllm.settings import connector_settings
from dataplane.client.vllm.state import UNCACHED, Load, Plan, Planner, Save
from dataplane.client.vllm.wait import LookupFound
from dataplane.client.vllm.worker import Loader, Registrar, Saver, load
from dataplane.memory.blockkv import BlockKV
from dataplane.wire.errors import InvalidLayout
from dataplane.wire.messages import KeyContext, KVFormat
from tests.helpers import FakeClock, ServerProcess, wait_until

CS = 32  # the server's chunk size in these tests
BS = 16  # vLLM's block size here: two blocks a chunk
LAYERS, HEADS, HD, NB = 2, 2, 8, 24


def vllm_cpu_caches(seed: int = 0) -> list[torch.Tensor]:
    """vLLM's CPU layout: per layer [num_blocks, heads, block_size, 2 * head_dim], all layers
    views of one buffer."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(LAYERS, NB, HEADS, BS, 2 * HD, generator=g).to(torch.bfloat16)
    return list(buf.unbind(0))


LATENT = 24  # the latent's width here (DeepSeek's: 512 + 64 rotary)


def latent_caches(seed: int = 0) -> list[torch.Tensor]:
    """Multi-head latent attention as vLLM keeps it: per layer [num_blocks, 1, block_size, latent]."""
    g = torch.Generator().manual_seed(seed)
    return list(torch.randn(LAYERS, NB, 1, BS, LATENT, generator=g).to(torch.bfloat16).unbind(0))


def scope(model: str = "m", fmt: KVFormat = KVFormat.VLLM_CPU, world: int = 1) -> Scope:
    return Scope(model, world, "bfloat16", LAYERS, HEADS, HD, fmt, BS)


@pytest.fixture
def server(tmp_path: Path) -> ServerProcess:
    srv = ServerProcess(tmp_path, "--chunk-size", str(CS))
    srv.wait_ready()
    yield srv
    srv.stop()


def worker(srv: ServerProcess, model: str = "m") -> WorkerAdapter:
    return WorkerAdapter(srv.endpoint, model, transfer_mode="engine_driven", heartbeat_interval=1.0)


# ------------------------------------------------------------------------------ the layout


def test_block_kv_moves_whole_blocks_byte_exact() -> None:
    src, dst = vllm_cpu_caches(1), vllm_cpu_caches(2)
    a, b = BlockKV.of_vllm_cpu(src), BlockKV.of_vllm_cpu(dst)
    assert (a.block_size, a.heads, a.head_dim, a.num_blocks) == (BS, HEADS, HD, NB)
    slots = np.concatenate([np.arange(5 * BS, 6 * BS), np.arange(2 * BS, 3 * BS)])  # blocks 5, 2
    buf = torch.empty(a.chunk_nbytes(len(slots)), dtype=torch.uint8)
    a.gather(slots, buf)
    out = np.concatenate([np.arange(7 * BS, 8 * BS), np.arange(0, BS)])  # into blocks 7, 0
    b.scatter(out, buf)
    for layer in range(LAYERS):
        assert torch.equal(dst[layer][7], src[layer][5]) and torch.equal(dst[layer][0], src[layer][2])
    assert torch.equal(dst[0][1], vllm_cpu_caches(2)[0][1])  # nothing else written


def test_block_kv_refuses_partial_blocks_and_other_shapes() -> None:
    kv = BlockKV.of_vllm_cpu(vllm_cpu_caches())
    buf = torch.empty(kv.chunk_nbytes(BS), dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole blocks of 16 tokens"):
        kv.gather(np.arange(3, 3 + BS), buf)
    with pytest.raises(ValueError, match=r"\[num_blocks, heads, block_size, 2 \* head_dim\]"):
        BlockKV.of_vllm_cpu([torch.zeros(4, 2, 16, 7)])


# ------------------------------------------------------------------- server: the format


def test_vllm_cpu_chunks_round_trip_and_are_looked_up_by_scope(server: ServerProcess) -> None:
    src, dst = vllm_cpu_caches(1), vllm_cpu_caches(2)
    tokens = np.arange(100, 100 + 3 * CS + 5)
    with worker(server) as w:
        w.register_kv_caches(src, "vllm_cpu")
        assert w.store_detail(tokens, np.arange(NB)).stored == 3
    lookup = ScopeLookup(server.endpoint, scope())
    try:
        assert lookup.hit_tokens(tokens) == 3 * CS and lookup.chunk_size == CS
        assert lookup.hit_tokens(tokens[: 2 * CS + 1]) == 2 * CS
        # another model, format or world size is another scope: nothing there
        for other in (scope("n"), scope(fmt=KVFormat.TOKEN_MAJOR), scope(world=2)):
            elsewhere = ScopeLookup(server.endpoint, other)
            assert elsewhere.hit_tokens(tokens) == 0
            elsewhere.close()
    finally:
        lookup.close()
    blocks = np.arange(NB)[::-1].copy()
    with worker(server) as w:
        w.register_kv_caches(dst, "vllm_cpu")
        assert w.retrieve(tokens, blocks) == 3 * CS
    for layer in range(LAYERS):
        for i in range(3 * CS // BS):
            assert torch.equal(dst[layer][blocks[i]], src[layer][i])


def test_a_token_major_worker_is_never_served_vllm_cpu_chunks(server: ServerProcess) -> None:
    tokens = np.arange(2 * CS)
    with worker(server) as w:
        w.register_kv_caches(vllm_cpu_caches(), "vllm_cpu")
        assert w.store(tokens, np.arange(NB))
        assert w.lookup(tokens) == 2 * CS
    same_dims = list(torch.zeros(LAYERS, 2, NB, BS, HEADS, HD, dtype=torch.bfloat16).unbind(0))
    with worker(server) as w:
        w.register_kv_caches(same_dims)  # token_major: the same model, dtype, layers, heads, head dim
        assert w.lookup(tokens) == 0 and w.retrieve(tokens, np.arange(NB)) == 0


def test_a_block_size_that_does_not_divide_the_chunk_is_refused_at_registration(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--chunk-size", "40")
    srv.wait_ready()
    try:
        with (
            worker(srv) as w,
            pytest.raises(InvalidLayout, match=r"chunk_size 40 is not a multiple of .* 16"),
        ):
            w.register_kv_caches(vllm_cpu_caches(), "vllm_cpu")
    finally:
        srv.stop()


def test_kv_format_is_checked_by_the_client() -> None:
    w = WorkerAdapter("tcp://127.0.0.1:1", "m")
    try:
        with pytest.raises(ValueError, match="kv_format 'nhd'"):
            w.register_kv_caches(vllm_cpu_caches(), "nhd")
        with pytest.raises(ValueError, match="server_driven workers register token_major memory"):
            w.register_kv_caches(vllm_cpu_caches(), "vllm_cpu")
    finally:
        w.close()


def _transfer_bytes(srv: ServerProcess, direction: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
    head = f'kvwarden_transfer_bytes_total{{direction="{direction}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(head))


def test_latent_chunks_hold_one_vector_a_token_and_serve_every_rank(server: ServerProcess) -> None:
    src = latent_caches(1)
    tokens = np.arange(500, 500 + 3 * CS + 5)
    with WorkerAdapter(server.endpoint, "m", 2, 0, transfer_mode="engine_driven") as w:
        w.register_kv_caches(src, "latent")
        assert w.store_detail(tokens, np.arange(NB)).stored == 3
    # a latent, not a K and a V: layers x tokens x latent x 2 bytes
    assert _transfer_bytes(server, "store") == LAYERS * 3 * CS * LATENT * 2
    # stored once by rank 0, held for every rank of any world size
    for world, rank in ((2, 0), (2, 1), (4, 3)):
        look = ScopeLookup(
            server.endpoint, Scope("m", world, "bfloat16", LAYERS, 1, LATENT, KVFormat.LATENT, BS)
        )
        try:
            assert look.hit_tokens(tokens) == 3 * CS
        finally:
            look.close()
        dst = latent_caches(2 + rank)
        blocks = np.arange(NB)[::-1].copy()
        with WorkerAdapter(server.endpoint, "m", world, rank, transfer_mode="engine_driven") as w:
            w.register_kv_caches(dst, "latent")
            assert w.retrieve(tokens, blocks) == 3 * CS
        for layer in range(LAYERS):
            for i in range(3 * CS // BS):
                assert torch.equal(dst[layer][blocks[i]], src[layer][i])
    # the same bytes a block as a vllm_cpu layout of one head and half the width: another format
    same_bytes = Scope("m", 1, "bfloat16", LAYERS, 1, LATENT // 2, KVFormat.VLLM_CPU, BS)
    for other in (same_bytes, Scope("m", 2, "bfloat16", LAYERS, 1, LATENT, KVFormat.VLLM_CPU, BS)):
        look = ScopeLookup(server.endpoint, other)
        try:
            assert look.hit_tokens(tokens) == 0
        finally:
            look.close()


def test_ranks_of_a_vllm_cpu_scope_never_share_chunks(server: ServerProcess) -> None:
    tokens = np.arange(2 * CS)
    with WorkerAdapter(server.endpoint, "m", 2, 0, transfer_mode="engine_driven") as w:
        w.register_kv_caches(vllm_cpu_caches(1), "vllm_cpu")
        assert w.store_detail(tokens, np.arange(NB)).stored == 2
    with WorkerAdapter(server.endpoint, "m", 2, 1, transfer_mode="engine_driven") as w:
        w.register_kv_caches(vllm_cpu_caches(2), "vllm_cpu")
        assert w.lookup(tokens) == 0 and w.retrieve(tokens, np.arange(NB)) == 0


def test_fp8_chunks_are_served_only_to_their_own_fp8_kind(server: ServerProcess) -> None:
    """fp8 KV (vLLM keeps it as bytes) is registered as what it is: never read by a bf16, an
    E5M2 or a plain-bytes scope of the same shape."""
    e4m3 = [t.to(torch.float8_e4m3fn) for t in vllm_cpu_caches(1)]
    tokens = np.arange(2 * CS)
    with worker(server) as w:
        w.register_kv_caches(e4m3, "vllm_cpu")
        assert w.store_detail(tokens, np.arange(NB)).stored == 2
    for dtype, hit in (("float8_e4m3fn", 2 * CS), ("float8_e5m2", 0), ("uint8", 0), ("bfloat16", 0)):
        look = ScopeLookup(server.endpoint, Scope("m", 1, dtype, LAYERS, HEADS, HD, KVFormat.VLLM_CPU, BS))
        try:
            assert look.hit_tokens(tokens) == hit, dtype
        finally:
            look.close()


def test_block_kv_takes_a_latent_as_one_head_of_one_vector() -> None:
    kv = BlockKV.of_engine(latent_caches(), KVFormat.LATENT)
    assert (kv.heads, kv.head_dim, kv.block_bytes) == (1, LATENT, BS * LATENT * 2)
    with pytest.raises(
        ValueError, match=r"latent KV tensors must be \[num_blocks, 1, block_size, latent_dim\]"
    ):
        BlockKV.of_engine([torch.zeros(4, 2, 16, 8)], KVFormat.LATENT)


# -------------------------------------------------------------- the scheduler's lookups


def test_scope_lookup_answers_zero_at_once_while_the_server_is_away(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    srv = ServerProcess(tmp_path, "--chunk-size", str(CS))
    srv.stop()
    clock = FakeClock()
    lookup = ScopeLookup(srv.endpoint, scope(), timeout_s=0.5, retry_s=5.0, clock=clock)
    try:
        with caplog.at_level(logging.WARNING):
            assert lookup.hit_tokens(np.arange(2 * CS)) == 0  # no server: a miss
            assert lookup.hit_tokens(np.arange(2 * CS)) == 0  # within retry_s: not even asked
        assert sum("until the server is back" in r.message for r in caplog.records) == 1
        srv = ServerProcess(
            tmp_path / "again", "--chunk-size", str(CS), port=srv.port, http_port=srv.http_port
        )
        srv.wait_ready()
        with worker(srv) as w:
            w.register_kv_caches(vllm_cpu_caches(), "vllm_cpu")
            w.store(np.arange(2 * CS), np.arange(NB))
        # still within retry_s (the clock stands still), but the channel connects again: asked
        caplog.set_level(logging.INFO, logger="dataplane.client.vllm.lookup")
        wait_until(lambda: lookup.hit_tokens(np.arange(2 * CS)) == 2 * CS, 10, what="a lookup answered")
        assert lookup.chunk_size == CS
        assert sum("answered again" in r.message for r in caplog.records) == 1
    finally:
        lookup.close()
        srv.stop()


def test_scope_lookup_keeps_resting_on_a_server_that_holds_its_connection_but_never_answers() -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    frozen = ctx.socket(zmq.ROUTER)  # takes the connection, never answers
    port = frozen.bind_to_random_port("tcp://127.0.0.1")
    clock = FakeClock()
    lookup = ScopeLookup(f"tcp://127.0.0.1:{port}", scope(), timeout_s=0.3, retry_s=5.0, clock=clock)
    try:
        assert not lookup.find(np.arange(2 * CS)).answered  # connected, no reply in time
        assert wait_until(lambda: frozen.poll(0), 5, what="the request to reach the frozen peer")
        frozen.recv_multipart()
        t0 = time.monotonic()
        for _ in range(5):  # no new connection: within retry_s, not asked (no wait at all)
            assert not lookup.find(np.arange(2 * CS)).answered
        assert time.monotonic() - t0 < 0.3
        assert not frozen.poll(100)  # nothing more was sent
        clock.advance(5.0)
        assert not lookup.find(np.arange(2 * CS)).answered  # past retry_s: asked again
        assert frozen.poll(1000)
    finally:
        lookup.close()
        frozen.close(linger=0)
        ctx.term()


def test_planner_loads_whole_chunks_never_the_last_token_and_stores_what_is_new() -> None:
    asked: list[int] = []

    def hits(tokens: np.ndarray, key: KeyContext | None) -> LookupFound:
        asked.append(len(tokens))
        return LookupFound(len(tokens) // CS * CS)  # the server holds everything asked for

    p = Planner(hits, BS)
    p.chunk_size = lambda: CS
    prompt = list(range(3 * CS))  # exactly 3 chunks: the last token must be computed
    assert p.matched("a", prompt, 0) == 2 * CS
    assert p.matched("a", prompt, 0) == 2 * CS and asked == [3 * CS - 1]  # one LOOKUP a request
    assert p.matched("a", prompt, 2 * CS) == 0  # vLLM already has them
    p.allocated("a", prompt, 2 * CS)
    blocks = list(range(10, 16))
    plan = p.plan([("a", prompt, [blocks], 2 * CS, CS)], [], False)
    (ld,) = plan.loads
    assert len(ld.tokens) == 2 * CS and list(ld.blocks) == blocks
    (sv,) = plan.saves  # the third chunk, computed this step, is stored; the loaded two are held
    assert len(sv.tokens) == 3 * CS and list(sv.blocks) == blocks
    assert p.finished("a") is True  # a store is planned: its blocks wait for the worker
    # chunked prefill: stores follow what has been computed, whole chunks only
    p.matched("b", list(range(5000, 5000 + 3 * CS)), 0)
    plan = p.plan([("b", list(range(5000, 5000 + 3 * CS)), [[1, 2]], 0, CS + 3)], [], False)
    assert [len(s.tokens) for s in plan.saves] == [CS]
    plan = p.plan([], [("b", [[3, 4, 5, 6]], False, CS + 3, 2 * CS - 3)], False)
    assert [len(s.tokens) for s in plan.saves] == [3 * CS] and list(plan.saves[0].blocks) == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]
    assert p.finished("c") is False  # never seen
    # a kv_consumer's planner: loads, and plans no save (its blocks are never held for one)
    p.stores = False
    p.matched("d", prompt, 0)
    p.allocated("d", prompt, 2 * CS)
    plan = p.plan([("d", prompt, [blocks], 2 * CS, CS)], [], False)
    assert len(plan.loads) == 1 and plan.saves == [] and p.finished("d") is False
    # a kv_producer's: never asks the server nor loads, and stores under the request's key
    p.stores, p.loads, asked[:] = True, False, []
    assert p.matched("e", prompt, 0, KeyContext(b"salt")) == 0 and asked == []  # (chunk size known)
    p.chunk_size = lambda: None
    assert p.matched("f", prompt, 0) == 0 and asked == [0]  # asked nothing but the chunk size
    p.chunk_size = lambda: CS
    (save,) = p.plan([("e", prompt, [blocks], 0, 3 * CS)], [], False).saves
    assert save.key == KeyContext(b"salt") and len(save.tokens) == 3 * CS


def test_planner_carries_each_requests_key_context_and_never_caches_an_uncached_one() -> None:
    asked: list[KeyContext | None] = []

    def hits(tokens: np.ndarray, key: KeyContext | None) -> LookupFound:
        asked.append(key)
        return LookupFound(len(tokens) // CS * CS)

    p = Planner(hits, BS)
    p.chunk_size = lambda: CS
    prompt, blocks = list(range(3 * CS)), list(range(6))
    ctx = KeyContext(b"tenant-a")
    assert p.matched("a", prompt, 0, ctx) == 2 * CS and asked == [ctx]
    p.allocated("a", prompt, 2 * CS)
    plan = p.plan([("a", prompt, [blocks], 2 * CS, CS)], [], False)
    assert [ld.key for ld in plan.loads] == [ctx] and [sv.key for sv in plan.saves] == [ctx]
    # a request whose KV no key can name: no LOOKUP, no load, no store
    assert p.matched("u", prompt, 0, UNCACHED) == 0 and asked == [ctx]
    p.allocated("u", prompt, 0)
    assert p.plan([("u", prompt, [blocks], 0, 3 * CS)], [], False) == Plan()
    assert p.finished("u") is False
    # one that was never looked up has no known context: it is not stored under a guessed one
    assert p.plan([("x", prompt, [blocks], 0, 3 * CS)], [], False) == Plan()
    assert p.finished("a") is True and "a" not in p.keys


def test_planner_says_which_hits_read_a_slower_tier() -> None:
    """The server's answer says how much of a hit it held in L1: a hit all in L1 is a memory
    copy (loaded on the step, with async_load "auto"), one reaching past it reads the file tier
    or Redis (loaded off the step)."""
    in_l1 = {"warm": 2 * CS, "half": CS, "cold": 0}

    def hits(tokens: np.ndarray, key: KeyContext | None) -> LookupFound:
        return LookupFound(len(tokens) // CS * CS, l1=in_l1[str(key.salt.decode()) if key else "warm"])

    p = Planner(hits, BS)
    p.chunk_size = lambda: CS
    prompt = list(range(3 * CS))
    for name, lower in (("warm", False), ("half", True), ("cold", True)):
        assert p.matched(name, prompt, 0, KeyContext(name.encode())) == 2 * CS
        assert p.from_lower_tiers(name) is lower
    assert p.from_lower_tiers("never-seen") is False
    assert p.finished("half") is False and p.from_lower_tiers("half") is False  # forgotten


def test_planner_loads_an_asynchronous_hit_before_it_is_scheduled_and_holds_its_blocks() -> None:
    def hits(tokens: np.ndarray, key: KeyContext | None) -> LookupFound:
        return LookupFound(len(tokens) // CS * CS)

    p = Planner(hits, BS)
    p.chunk_size = lambda: CS
    prompt, blocks = list(range(3 * CS)), list(range(10, 16))
    assert p.matched("a", prompt, 0) == 2 * CS and not p.copies_own("a")
    p.allocated("a", prompt, 2 * CS, [blocks])  # vLLM loads it asynchronously: not scheduled
    plan = p.plan([], [], False)
    (ld,) = plan.loads
    assert ld.background and len(ld.tokens) == 2 * CS and list(ld.blocks) == blocks and not plan.saves
    assert p.loading == {"a"}
    assert p.plan([], [], False) == Plan()  # planned once
    p.loaded({"a"})  # the workers report it over; vLLM schedules it from its loaded prefix
    plan = p.plan([("a", prompt, [blocks], 2 * CS, CS)], [], False)
    assert not plan.loads and [len(s.tokens) for s in plan.saves] == [3 * CS]  # only what is new
    assert p.finished("a") is True  # its save holds the blocks

    # a's save is on its way: a request with its prefix copies a's blocks, on the step
    assert p.matched("own", prompt, 0) == 2 * CS and p.copies_own("own")

    # finished (aborted) while its load runs: its blocks wait for the load's report
    other = list(range(1000, 1000 + 3 * CS))
    assert p.matched("b", other, 0) == 2 * CS and not p.copies_own("b")
    p.allocated("b", other, 2 * CS, [blocks])
    assert [ld.req_id for ld in p.plan([], [], False).loads] == ["b"]
    assert p.finished("b") is True and "b" not in p.loading

    # allocated asynchronously but scheduled in the same step after all: loaded on the step
    third = list(range(2000, 2000 + 3 * CS))
    assert p.matched("c", third, 0) == 2 * CS
    p.allocated("c", third, 2 * CS, [blocks])
    plan = p.plan([("c", third, [blocks], 2 * CS, CS)], [], False)
    (ld,) = plan.loads
    assert not ld.background and "c" not in p.loading


def test_the_loader_loads_off_the_step_and_reports_each_load_once(server: ServerProcess) -> None:
    with worker(server) as w:
        w.register_kv_caches(vllm_cpu_caches(), "vllm_cpu")
        tokens = np.arange(3 * CS)
        assert w.store(tokens[:CS], np.arange(NB))  # only the first chunk is held
        loader = Loader(w, BS)
        loader.start()
        try:
            loader.submit([Load("a", tokens[:CS], np.array([9, 8]), background=True)])
            loader.submit([Load("b", tokens[: 2 * CS], np.array([7, 6, 5, 4]), background=True)])
            done: dict[str, set[int]] = {}

            def both() -> bool:
                done.update(loader.take_done())
                return len(done) == 2

            wait_until(both, 30, what="two loads over")
            assert done == {"a": set(), "b": {5, 4}}  # b's second chunk is not held: recompute it
            assert loader.take_done() == []  # each reported once
            loader.stop()
            assert loader.join()
        finally:
            loader.stop()
    stopped = Loader(worker(server), BS)  # loads still queued at a stop: every block unfilled
    stopped.submit([Load("c", tokens[:CS], np.array([1, 2]), background=True)])
    stopped.stop()
    stopped._run()
    assert stopped.take_done() == [("c", {1, 2})]
    stopped.adapter.close()


# ------------------------------------------------------------------ the worker's threads


def test_registrar_waits_for_a_server_that_starts_later(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--chunk-size", str(CS))
    srv.stop()
    w = worker(srv)
    reg = Registrar(w, vllm_cpu_caches(), "vllm_cpu", retry_s=0.2)
    reg.start()
    try:
        assert reg.wait(0.5) is False and reg.error is None
        srv = ServerProcess(tmp_path / "up", "--chunk-size", str(CS), port=srv.port, http_port=srv.http_port)
        srv.wait_ready()
        assert reg.wait(30.0) is True
        assert w.store(np.arange(CS), np.arange(NB))
    finally:
        reg.stop()
        assert reg.join()
        w.close()
        srv.stop()


def test_registrar_takes_a_refusal_as_final(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, "--chunk-size", "40")
    srv.wait_ready()
    w = worker(srv)
    reg = Registrar(w, vllm_cpu_caches(), "vllm_cpu", retry_s=0.2)
    reg.start()
    try:
        assert reg.wait(30.0) is False
        assert isinstance(reg.error, InvalidLayout)
        assert reg.join(5.0)  # it stopped trying
    finally:
        w.close()
        srv.stop()


def test_saver_stores_off_the_step_and_frees_only_what_it_was_asked_to(server: ServerProcess) -> None:
    with worker(server) as w:
        w.register_kv_caches(vllm_cpu_caches(), "vllm_cpu")
        saver = Saver(w)
        saver.start()
        try:
            tokens = np.arange(2 * CS)
            saver.submit([Save("a", tokens, np.arange(4))])
            assert saver.drain(30.0)
            assert w.lookup(tokens) == 2 * CS and saver.stored_chunks == 2
            assert saver.finished(set(), {"a"}) == set()  # not finished yet: blocks stay
            assert saver.finished({"a", "z"}, {"a"}) == {"a"}  # z was never saved: not ours
            assert saver.finished(set(), {"a"}) == set()  # reported once
        finally:
            saver.stop()
            assert saver.join()


def test_a_saver_that_does_not_store_reports_its_saves_over(server: ServerProcess) -> None:
    """A rank whose bytes rank 0 stores (the latent): its saves are over at once, nothing sent."""
    with WorkerAdapter(server.endpoint, "m", 2, 1, transfer_mode="engine_driven") as w:
        w.register_kv_caches(latent_caches(), "latent")
        saver = Saver(w, store=False)
        saver.start()
        try:
            tokens = np.arange(2 * CS)
            saver.submit([Save("a", tokens, np.arange(4), seq=7)])
            assert saver.drain(30.0)
            assert saver.take_done() == [7] and saver.finished({"a"}, {"a"}) == {"a"}
            assert w.lookup(tokens) == 0 and saver.stored_chunks == 0
        finally:
            saver.stop()
            assert saver.join()


def test_a_load_that_comes_back_short_names_the_blocks_to_recompute(server: ServerProcess) -> None:
    with worker(server) as w:
        w.register_kv_caches(vllm_cpu_caches(), "vllm_cpu")
        tokens = np.arange(3 * CS)
        assert w.store(tokens[:CS], np.arange(NB))  # only the first chunk is held
        blocks = np.array([9, 8, 7, 6, 5, 4])
        assert load(w, Load("r", tokens, blocks), BS) == {7, 6, 5, 4}
        assert load(w, Load("r", tokens[:CS], blocks), BS) == set()
    unregistered = worker(server)
    try:
        assert load(unregistered, Load("r", tokens, blocks), BS) == set(blocks.tolist())
    finally:
        unregistered.close()


def test_connector_settings_name_the_bad_key() -> None:
    cfg = connector_settings({"kvwarden.url": "tcp://h:1", "other.key": 1})
    assert cfg["kvwarden.url"] == "tcp://h:1" and cfg["kvwarden.transfer_mode"] == "auto"
    with pytest.raises(ValueError, match=r"unknown key 'kvwarden\.urll'"):
        connector_settings({"kvwarden.urll": "x"})
    with pytest.raises(ValueError, match=r"\['kvwarden.retry_s'\]: must be > 0"):
        connector_settings({"kvwarden.retry_s": 0})
    with pytest.raises(ValueError, match="'gpu_direct'; use auto, engine_driven, server_driven"):
        connector_settings({"kvwarden.transfer_mode": "gpu_direct"})
    with pytest.raises(ValueError, match="'soon' is not a float"):
        connector_settings({"kvwarden.connect_wait_s": "soon"})
    assert cfg["kvwarden.async_load"] == "auto"  # off the step when a hit reads a slower tier
    assert connector_settings({"kvwarden.async_load": False})["kvwarden.async_load"] is False
    assert connector_settings({"kvwarden.async_load": "false"})["kvwarden.async_load"] is False
    assert connector_settings({"kvwarden.async_load": "true"})["kvwarden.async_load"] is True
    # vLLM's kv_role: what acts on loads alone is refused for a producer, which never loads
    assert connector_settings({"kvwarden.prefetch": False}, "kv_consumer")["kvwarden.prefetch"] is False
    for key in ("kvwarden.async_load", "kvwarden.prefetch", "kvwarden.lookup_wait_s"):
        with pytest.raises(ValueError, match=rf"\[{key!r}\]: a kv_producer never loads"):
            connector_settings({key: 1}, "kv_producer")
    assert connector_settings({"kvwarden.retry_s": 1}, "kv_producer")["kvwarden.retry_s"] == 1
    with pytest.raises(
        ValueError, match="kv_role 'kv_both ': kvwarden takes kv_producer, kv_consumer, kv_both"
    ):
        connector_settings({}, "kv_both ")
    assert connector_settings({"kvwarden.async_load": "AUTO"})["kvwarden.async_load"] == "auto"
    with pytest.raises(
        ValueError, match=r"\['kvwarden.async_load'\]: 1 is not a boolean \(true or false\) or \"auto\""
    ):
        connector_settings({"kvwarden.async_load": 1})
    assert cfg["kvwarden.prefetch"] is True
    with pytest.raises(ValueError, match=r"\['kvwarden.prefetch'\]: 'soon' is not a boolean"):
        connector_settings({"kvwarden.prefetch": "soon"})
