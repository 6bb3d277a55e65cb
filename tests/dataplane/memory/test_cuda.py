"""The CUDA path: KV caches on the GPU, shared with a real server process through CUDA IPC.

These run only where CUDA is available (``scripts/gpu-check.sh`` runs them on a CUDA host).
The server is a separate process: CUDA IPC handles cannot be opened by the process that made
them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from tests.conftest import ServerFactory
from tests.helpers import ServerProcess

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHUNK = 32
LAYERS, BLOCKS, BS, HEADS, HD = 4, 64, 16, 2, 8


@pytest.fixture
def server(make_server: ServerFactory) -> ServerProcess:
    return make_server("--chunk-size", str(CHUNK), "--l1-size-gb", "0.1")


def _tokens(caches: list[torch.Tensor], blocks: np.ndarray, n: int) -> torch.Tensor:
    idx = torch.from_numpy(blocks).to(caches[0].device)
    return torch.stack([c.index_select(1, idx).reshape(2, -1, HEADS, HD)[:, :n] for c in caches]).cpu()


def test_cuda_store_and_retrieve_through_ipc(server: ServerProcess) -> None:
    src = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.bfloat16, device="cuda")
    for c in src:
        c.copy_(torch.randn(c.shape, device="cuda").to(c.dtype))
    dst = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.bfloat16, device="cuda")
    shm = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.bfloat16, device="cpu")
    tokens = np.arange(5 * CHUNK + 7)
    rng = np.random.default_rng(0)
    b_src, b_dst, b_cpu = (rng.permutation(BLOCKS)[:12] for _ in range(3))
    a = WorkerAdapter(server.endpoint, "m")
    b = WorkerAdapter(server.endpoint, "m")
    c = WorkerAdapter(server.endpoint, "m")
    try:
        a.register_kv_caches(src)
        assert a.store_detail(tokens, b_src).stored == 5
        b.register_kv_caches(dst)
        assert b.retrieve(tokens, b_dst) == 5 * CHUNK
        torch.cuda.synchronize()
        assert torch.equal(_tokens(src, b_src, 5 * CHUNK), _tokens(dst, b_dst, 5 * CHUNK))
        c.register_kv_caches(shm)  # a CPU worker reads what a GPU worker stored
        assert c.retrieve(tokens, b_cpu) == 5 * CHUNK
        assert torch.equal(_tokens(src, b_src, 5 * CHUNK), _tokens(shm, b_cpu, 5 * CHUNK))
    finally:
        a.close()
        b.close()
        c.close()


def test_cuda_token_slots_both_ways(make_server: ServerFactory) -> None:
    """Chunks that are not whole blocks (24 tokens, blocks of 16) move token by token between a
    GPU worker and L1, in both directions, and a CPU worker's chunks land on a GPU worker."""
    srv = make_server("--chunk-size", "24", "--l1-size-gb", "0.1")
    src = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.float16, device="cuda")
    for t in src:
        t.copy_(torch.randn(t.shape, device="cuda").to(t.dtype))
    cpu = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.float16, device="cpu")
    for t in cpu:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    dst = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.float16, device="cuda")
    rng = np.random.default_rng(1)
    b_src, b_cpu, b_dst = (rng.permutation(BLOCKS)[:8] for _ in range(3))
    gpu_tokens, cpu_tokens = np.arange(4 * 24 + 5), np.arange(10_000, 10_000 + 3 * 24)
    a, b, c = (WorkerAdapter(srv.endpoint, "m") for _ in range(3))
    try:
        a.register_kv_caches(src)
        b.register_kv_caches(cpu)
        c.register_kv_caches(dst)
        assert a.store_detail(gpu_tokens, b_src).stored == 4
        assert b.store_detail(cpu_tokens, b_cpu).stored == 3
        assert c.retrieve(gpu_tokens, b_dst) == 4 * 24
        torch.cuda.synchronize()
        assert torch.equal(_tokens(src, b_src, 4 * 24), _tokens(dst, b_dst, 4 * 24))
        assert c.retrieve(cpu_tokens, b_dst) == 3 * 24
        torch.cuda.synchronize()
        assert torch.equal(_tokens(cpu, b_cpu, 3 * 24), _tokens(dst, b_dst, 3 * 24))
    finally:
        for w in (a, b, c):
            w.close()


def test_cuda_engine_driven(server: ServerProcess) -> None:
    src = [torch.randn(2, BLOCKS, BS, HEADS, HD, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]
    dst = [torch.zeros_like(t) for t in src]
    tokens = np.arange(3 * CHUNK)
    blocks = np.arange(6)
    a = WorkerAdapter(server.endpoint, "m", transfer_mode="engine_driven")
    b = WorkerAdapter(server.endpoint, "m", transfer_mode="engine_driven")
    try:
        a.register_kv_caches(src)
        assert a.store(tokens, blocks)
        b.register_kv_caches(dst)
        assert b.retrieve(tokens, blocks + 10) == 3 * CHUNK
        torch.cuda.synchronize()
        assert torch.equal(_tokens(src, blocks, 3 * CHUNK), _tokens(dst, blocks + 10, 3 * CHUNK))
    finally:
        a.close()
        b.close()
