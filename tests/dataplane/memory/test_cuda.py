"""The CUDA path: KV caches on the GPU, shared with a real server process through CUDA IPC.

These run only where CUDA is available (``scripts/gpu-check.sh`` runs them on a CUDA host).
The server is a separate process: CUDA IPC handles cannot be opened by the process that made
them.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.memory.blendcopy import Geometry, cache_side, chunk_side, move
from dataplane.memory.kvmemory import map_local_tensors
from dataplane.memory.rope import RopeParams, RopeTables
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


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_cuda_blend_moves_rotate_keys_on_the_gpu_as_on_the_cpu(style: str) -> None:
    """A blend STORE from GPU memory (keys back by 300 positions) gives the chunk the same
    cache on the CPU gives (values bit for bit, keys within one rounding); its RETRIEVE into GPU
    memory at other slots (keys on by 300) puts the keys back where they started."""
    layers, blocks, bs, heads, hd, cs = 3, 12, 8, 2, 64, 32
    tables = RopeTables(RopeParams(48, 10000.0, style, 1.0, 2048).check(hd))
    g = Geometry(torch.bfloat16, layers, cs, heads, hd)
    gen = torch.Generator().manual_seed(11)
    host = [torch.randn(2, blocks, bs, heads, hd, generator=gen).to(torch.bfloat16) for _ in range(layers)]
    cpu, gpu = map_local_tensors(host), map_local_tensors([t.cuda() for t in host])
    slots = np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in (7, 2, 9, 4)]).astype(np.int64)
    chunks = []
    for kv in (cpu, gpu):
        buf = torch.zeros(kv.chunk_nbytes(cs), dtype=torch.uint8)
        fill = partial(kv.gather, slots)
        move(tables, cache_side(kv, slots), chunk_side(buf, g), -300, g, None, False, fill)
        chunks.append(buf.view(torch.bfloat16).view(layers, 2, cs, heads, hd))
    on_cpu, on_gpu = chunks
    assert torch.equal(on_cpu[:, 1], on_gpu[:, 1])
    assert torch.allclose(on_cpu[:, 0].float(), on_gpu[:, 0].float(), rtol=2**-7, atol=1e-6)
    assert not torch.equal(on_gpu[:, 0], torch.stack([t.view(2, -1, heads, hd)[0, slots] for t in host]))
    stored = on_gpu.view(torch.uint8).reshape(-1)
    back = np.concatenate([np.arange(b * bs, (b + 1) * bs) for b in (0, 1, 10, 11)]).astype(np.int64)
    move(
        tables,
        chunk_side(stored, g),
        cache_side(gpu, back),
        300,
        g,
        None,
        False,
        lambda w: w.copy_(stored),
        partial(gpu.scatter, back),
    )
    torch.cuda.synchronize()
    again, orig = torch.zeros_like(stored), torch.zeros_like(stored)
    gpu.gather(back, again)
    cpu.gather(slots, orig)
    o, a = (x.view(torch.bfloat16).view(layers, 2, cs, heads, hd) for x in (orig, again))
    assert torch.equal(o[:, 1], a[:, 1])
    assert float((o[:, 0].float() - a[:, 0].float()).abs().max()) <= 0.05
