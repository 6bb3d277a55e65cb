"""Blend transfers with a real server, both transfer modes: a chunk stored at one position and
blend-retrieved at another has its keys re-rotated to the new position (equal to RoPE computed
there, within bf16 tolerance) and its values untouched; chunks are found independently of their
prefix; the per-instance RoPE state is dropped by reap, admin reap and UNREGISTER; bad
parameters and blend requests without them are refused, naming the problem."""

from __future__ import annotations

import math
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from dataplane.memory.rope import RopeParams, rope_at
from dataplane.memory.rope_kernel import KernelWarmup
from dataplane.wire.errors import RequestError
from dataplane.wire.messages import BlendAcquire, BlendRegister, BlendReserve, BlendStore
from dataplane.wire.protocol import encode_message
from tests.conftest import DealerFactory
from tests.dataplane.registration import register_message
from tests.helpers import ServerProcess, call, next_rid, subprocess_env, wait_until

CS, LAYERS, NB, BS, HEADS, HD = 32, 2, 64, 16, 2, 64
ROPE = RopeParams(64, 10000.0, "neox", 1.0, 4096)
TOKEN = "blend-test-admin-token"


@pytest.fixture(scope="module", autouse=True)
def worker_kernels() -> None:
    """This process is the workers': its rotation kernels compiled (one-copy engine-driven
    workers rotate themselves; `tests/dataplane/memory/test_blendcopy.py` covers the torch path)."""
    warm = KernelWarmup()
    warm.start()
    warm.join(300.0)
    assert warm.ready, warm.state


def start_server(tmp_path: Path, *args: str) -> ServerProcess:
    env = subprocess_env(KVWARDEN_ADMIN_TOKEN=TOKEN)
    srv = ServerProcess(tmp_path, "--chunk-size", str(CS), *args, env=env)
    srv.wait_ready()
    return srv


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path)
    yield srv
    srv.stop()


@pytest.fixture(params=["shm", "private"])
def engine_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """A server whose L1 engine-driven workers map (one copy, the worker rotating), or not
    (through the pool, the server rotating)."""
    srv = start_server(tmp_path, "--l1-backing", str(request.param))
    yield srv
    srv.stop()


def worker(
    srv: ServerProcess, mode: str = "server_driven", pool_chunks: int = 4
) -> tuple[WorkerAdapter, list[torch.Tensor]]:
    w = WorkerAdapter(
        srv.endpoint, "blend-model", transfer_mode=mode, heartbeat_interval=1.0, pool_chunks=pool_chunks
    )
    caches = allocate_kv_caches(LAYERS, NB, BS, HEADS, HD, dtype=torch.bfloat16)
    w.register_kv_caches(caches)
    return w, caches


def slots(blocks: list[int], n: int) -> torch.Tensor:
    return torch.tensor([b * BS + o for b in blocks for o in range(BS)][:n])


def kv_at(caches: list[torch.Tensor], layer: int, which: int, s: torch.Tensor) -> torch.Tensor:
    return caches[layer][which].reshape(NB * BS, HEADS, HD)[s]


def fill(
    caches: list[torch.Tensor], blocks: list[int], raw_k: torch.Tensor, values: torch.Tensor, at: int
) -> None:
    """The worker's own prefill: K with RoPE at positions ``at ..``, V as given."""
    s = slots(blocks, raw_k.shape[1])
    for layer in range(LAYERS):
        k = rope_at(raw_k[layer], torch.arange(raw_k.shape[1]) + at, ROPE).to(torch.bfloat16)
        caches[layer][0].reshape(NB * BS, HEADS, HD)[s] = k
        caches[layer][1].reshape(NB * BS, HEADS, HD)[s] = values[layer]


def status(srv: ServerProcess) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"http://127.0.0.1:{srv.http_port}/status", timeout=10).json()
    return body


def blend_count(srv: ServerProcess) -> int:
    return int(status(srv)["worker_liveness"]["blend_instances"])


def kernel_state(srv: ServerProcess) -> str:
    return str(status(srv)["worker_liveness"]["blend_kernel"])


def wait_for_kernels(srv: ServerProcess) -> None:
    """The compiled rotation is built after the first BLEND_REGISTER; until then torch serves."""
    wait_until(lambda: kernel_state(srv) != "compiling", 120.0, 0.1, what="the blend kernels")
    assert kernel_state(srv) == "ready"


@pytest.mark.parametrize(
    ("mode", "backing"), [("server_driven", "auto"), ("engine_driven", "shm"), ("engine_driven", "private")]
)
def test_a_chunk_stored_at_0_and_retrieved_at_512_equals_rope_at_512(
    tmp_path: Path, mode: str, backing: str
) -> None:
    server = start_server(tmp_path, "--l1-backing", backing)
    try:
        _stored_at_0_retrieved_at_512(server, mode)
    finally:
        server.stop()


def _stored_at_0_retrieved_at_512(server: ServerProcess, mode: str) -> None:
    g = torch.Generator().manual_seed(3)
    tokens = np.arange(1000, 1000 + 2 * CS)
    raw_k = torch.randn(LAYERS, 2 * CS, HEADS, HD, generator=g)
    values = torch.randn(LAYERS, 2 * CS, HEADS, HD, generator=g).to(torch.bfloat16)
    a, ca = worker(server, mode)
    b, cb = worker(server, mode)
    try:
        fill(ca, [0, 1, 2, 3], raw_k, values, at=0)
        assert kernel_state(server) == "idle"  # nothing compiled before blend is used
        a.register_blend(ROPE)
        wait_for_kernels(server)
        assert a.store_blend(tokens, [0, 1, 2, 3], position=0).stored == 2
        b.register_blend(
            {"rotary_dim": 64, "base": 10000, "style": "neox", "scaling": 1.0, "max_positions": 4096}
        )
        assert blend_count(server) == 2
        dst = [20, 21, 22, 23]
        assert b.retrieve_blend(tokens, dst, position=512) == [(0, True), (1, True)]
        s = slots(dst, 2 * CS)
        for layer in range(LAYERS):
            want = rope_at(raw_k[layer], torch.arange(2 * CS) + 512, ROPE).to(torch.bfloat16)
            got = kv_at(cb, layer, 0, s)
            err = (got.float() - want.float()).abs()
            assert float(err.max()) <= 0.05, float(err.max())
            assert (
                float((kv_at(ca, layer, 0, slots([0, 1, 2, 3], 2 * CS)).float() - want.float()).abs().max())
                > 0.5
            )
            assert torch.equal(kv_at(cb, layer, 1, s), values[layer])  # values untouched
        # independent of the prefix: the second chunk after another first chunk, at 100
        other = np.concatenate([np.arange(5000, 5000 + CS), tokens[CS:]])
        assert b.retrieve_blend(other, [30, 31, 32, 33], position=100) == [(0, False), (1, True)]
        s2 = slots([32, 33], CS)
        want = rope_at(raw_k[0, CS:], torch.arange(CS) + 100 + CS, ROPE).to(torch.bfloat16)
        assert float((kv_at(cb, 0, 0, s2).float() - want.float()).abs().max()) <= 0.05
    finally:
        a.close()
        b.close()
    assert blend_count(server) == 0  # UNREGISTER dropped both


def test_reap_and_admin_reap_drop_only_that_instances_blend_state(
    server: ServerProcess, make_dealer: DealerFactory
) -> None:
    """b registers by hand, with no heartbeat: a `WorkerAdapter`'s would find its instance reaped
    at its next PING (every second) and register it again, RoPE parameters included, at a
    moment no test can know, and the count would be 2 again."""
    url = f"http://127.0.0.1:{server.http_port}"
    a, _ = worker(server)
    b = make_dealer(server.endpoint)
    b_caches = allocate_kv_caches(LAYERS, NB, BS, HEADS, HD, dtype=torch.bfloat16)
    b_id, b_secret = secrets.randbits(63), secrets.token_bytes(16)
    rope = (ROPE.rotary_dim, ROPE.base, ROPE.style, ROPE.scaling, ROPE.max_positions)
    try:
        a.register_blend(ROPE)
        for msg in (
            register_message(b_id, b_caches, "blend-model", b_secret),
            BlendRegister(b_id, b_secret, *rope),
        ):
            reply = call(b, encode_message(next_rid(), msg))
            assert reply.ok, reply.body
        assert blend_count(server) == 2
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = httpx.post(f"{url}/instances/{b_id}/reap", headers=auth, timeout=10)
        assert r.status_code == 200 and r.json()["reaped"] is True
        assert blend_count(server) == 1  # b's tables went, a's stay
        r = httpx.post(f"{url}/instances/{12345}/reap", headers=auth, timeout=10)
        assert r.status_code == 404 and blend_count(server) == 1  # an unknown id: nothing
        a.store_blend(np.arange(CS), [0, 1], position=0)  # a still blends
    finally:
        a.close()
        free_kv_caches(b_caches)
    assert blend_count(server) == 0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"rotary_dim": 63}, "rotary_dim: 63 must be a positive even"),
        ({"rotary_dim": 128}, "rotary_dim: 128 exceeds the head dim 64"),
        ({"base": 0.0}, "base: 0.0 must be a finite number > 0"),
        ({"base": math.nan}, "base: nan"),
        ({"scaling": -1.0}, "scaling: -1.0"),
        ({"style": "rotate-half"}, "style: 'rotate-half'"),
        ({"max_positions": 10**12}, "max_positions: 1000000000000"),
    ],
)
def test_bad_rope_parameters_are_named(server: ServerProcess, change: dict[str, Any], named: str) -> None:
    w, _ = worker(server)
    try:
        params = {"rotary_dim": 64, "base": 10000.0, "style": "neox", "scaling": 1.0, "max_positions": 4096}
        with pytest.raises(RequestError) as exc:
            w.register_blend({**params, **change})
        assert named in str(exc.value) and "BLEND_REGISTER" in str(exc.value)
        assert blend_count(server) == 0
    finally:
        w.close()


def test_blend_requests_without_rope_parameters_are_refused(server: ServerProcess) -> None:
    w, _ = worker(server)
    e, _ = worker(server, "engine_driven", pool_chunks=2)
    try:
        for call in (
            lambda: w.store_blend(np.arange(CS), [0, 1], 0),
            lambda: w.retrieve_blend(np.arange(CS), [0, 1], 0),
            lambda: e.store_blend(np.arange(CS), [0, 1], 0),
            lambda: e._send(BlendReserve(e.instance_id, e._secret, np.arange(CS))),
            lambda: e._send(BlendAcquire(e.instance_id, e._secret, np.arange(CS))),
        ):
            with pytest.raises(RequestError, match="has not registered its RoPE parameters"):
                call()
        w.register_blend(ROPE)
        e.register_blend(ROPE)
        with pytest.raises(RequestError, match="exceed the registered max_positions 4096"):
            w.store_blend(np.arange(CS), [0, 1], position=4090)
        # on the wire, an engine_driven request names what it must not carry and what it may
        blocks = np.array([0, 1], dtype=np.int64)
        with pytest.raises(RequestError, match="block_ids: an engine_driven instance copies its own blocks"):
            e._send(BlendStore(e.instance_id, e._secret, np.arange(CS), blocks, 0))
        none = np.zeros(0, dtype=np.int64)
        with pytest.raises(RequestError, match="token_ids: 3 chunks exceed the pool's 2 slots"):
            e._send(BlendStore(e.instance_id, e._secret, np.arange(3 * CS), none, 0))
        assert status(server)["is_healthy"] is True  # none of it hurt the server
    finally:
        w.close()
        e.close()


def test_engine_driven_blend_moves_more_chunks_than_its_pool(engine_server: ServerProcess) -> None:
    """Six chunks, a pool of four slots: through the pool, two requests each way; one copy, one
    request; every chunk where it belongs (a hit pattern with a gap proves the batches keep
    their chunk indices)."""
    server = engine_server
    g = torch.Generator().manual_seed(5)
    n = 6
    tokens = np.arange(7000, 7000 + n * CS)
    raw_k = torch.randn(LAYERS, n * CS, HEADS, HD, generator=g)
    values = torch.randn(LAYERS, n * CS, HEADS, HD, generator=g).to(torch.bfloat16)
    src_blocks = list(range(0, 2 * n))
    a, ca = worker(server, "engine_driven")
    try:
        fill(ca, src_blocks, raw_k, values, at=64)
        a.register_blend(ROPE)
        r = a.store_blend(tokens, src_blocks, position=64)
        assert (r.chunks, r.stored) == (n, n)
        mixed = tokens.copy()
        mixed[4 * CS : 5 * CS] = 1  # chunk 4 was never stored
        dst = list(range(20, 20 + 2 * n))
        assert a.retrieve_blend(mixed, dst, position=1000) == [(i, i != 4) for i in range(n)]
        for c in (0, 3, 5):
            s = slots(dst, n * CS)[c * CS : (c + 1) * CS]
            want = rope_at(raw_k[1, c * CS : (c + 1) * CS], torch.arange(CS) + 1000 + c * CS, ROPE)
            assert float((kv_at(ca, 1, 0, s).float() - want).abs().max()) <= 0.05
            assert torch.equal(kv_at(ca, 1, 1, s), values[1, c * CS : (c + 1) * CS])
        one_copy = status(server)["storage"]["l1"]["arena"]["backing"] == "shm"
        # the way the bytes went: one copy (the worker rotating) or the pool (the server rotating)
        assert ok_requests(server, "BLEND_RESERVE") == (1 if one_copy else 0)
        assert ok_requests(server, "BLEND_ACQUIRE") == (1 if one_copy else 0)
        assert ok_requests(server, "BLEND_STORE") == (0 if one_copy else 2)
        assert ok_requests(server, "BLEND_RETRIEVE") == (0 if one_copy else 2)
    finally:
        a.close()


def ok_requests(srv: ServerProcess, kind: str) -> int:
    text = httpx.get(f"http://127.0.0.1:{srv.http_port}/metrics", timeout=10).text
    m = re.search(rf'kvwarden_requests_total{{outcome="ok",type="{kind}"}} (\S+)', text)
    return int(float(m.group(1))) if m else 0
