"""Engine-driven adapters: ordinary tensors, bytes through the server's chunk pool."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.memory import shm
from dataplane.server.config import Settings
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.wire.replies import StoreCounts
from tests.helpers import free_port

CHUNK = 32
LAYERS, BLOCKS, BS, HEADS, HD = 3, 64, 16, 2, 8


@pytest.fixture
def dp() -> Iterator[DataPlane]:
    d = build_dataplane(Settings(port=free_port(), http_port=free_port(), chunk_size=CHUNK, l1_size_gb=0.05))
    d.start()
    yield d
    d.stop()


def _endpoint(d: DataPlane) -> str:
    return d.server.bound_endpoint


def _separate() -> list[torch.Tensor]:
    return [torch.zeros(2, BLOCKS, BS, HEADS, HD, dtype=torch.bfloat16) for _ in range(LAYERS)]


def _one_tensor() -> list[torch.Tensor]:
    return list(torch.zeros(LAYERS, 2, BLOCKS, BS, HEADS, HD, dtype=torch.bfloat16).unbind(0))


def _tokens_view(caches: list[torch.Tensor], blocks: np.ndarray, n: int) -> list[torch.Tensor]:
    return [c[:, torch.from_numpy(blocks)].reshape(2, -1, HEADS, HD)[:, :n] for c in caches]


@pytest.mark.parametrize("layout", [_separate, _one_tensor], ids=["per-layer", "one-tensor"])
@pytest.mark.parametrize(("pool_chunks", "copy_threads"), [(1, None), (3, 3)])
def test_engine_driven_round_trip(
    dp: DataPlane, layout: Callable[[], list[torch.Tensor]], pool_chunks: int, copy_threads: int | None
) -> None:
    src = layout()
    for c in src:
        c.copy_(torch.randn(c.shape).to(c.dtype))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50_000, 7 * CHUNK + 5)
    b_src = rng.permutation(BLOCKS)[:30]
    a = WorkerAdapter(
        _endpoint(dp), "m", transfer_mode="engine_driven", pool_chunks=pool_chunks, copy_threads=copy_threads
    )
    b = WorkerAdapter(
        _endpoint(dp), "m", transfer_mode="engine_driven", pool_chunks=2, copy_threads=copy_threads
    )
    try:
        a.register_kv_caches(src)
        r = a.store_detail(tokens, b_src)
        assert r == StoreCounts(7, 7, 0, 0, 0)
        assert a.store_detail(tokens, b_src).present == 7  # nothing copied twice
        dst = layout()
        b.register_kv_caches(dst)
        assert b.lookup(tokens) == 7 * CHUNK
        b_dst = rng.permutation(BLOCKS)[:30]
        assert b.retrieve(tokens, b_dst) == 7 * CHUNK
        n = 7 * CHUNK
        for x, y in zip(_tokens_view(src, b_src, n), _tokens_view(dst, b_dst, n), strict=True):
            assert torch.equal(x, y)
    finally:
        a.close()
        b.close()
    assert dp.engine.registry.tracked_instance_count() == 0


def test_copy_threads_is_checked_and_only_for_engine_driven_workers() -> None:
    with pytest.raises(ValueError, match="copy_threads applies to engine_driven workers"):
        WorkerAdapter("tcp://127.0.0.1:1", "m", copy_threads=2)
    for bad in (0, -1, 65):
        with pytest.raises(ValueError, match=r"copy_threads must be in \[1, 64\]"):
            WorkerAdapter("tcp://127.0.0.1:1", "m", transfer_mode="engine_driven", copy_threads=bad)


def test_engine_and_server_driven_share_chunks(dp: DataPlane) -> None:
    src = _separate()
    for c in src:
        c.copy_(torch.randn(c.shape).to(c.dtype))
    tokens = np.arange(4 * CHUNK)
    blocks = np.arange(8)
    eng = WorkerAdapter(_endpoint(dp), "m", transfer_mode="engine_driven")
    srv = WorkerAdapter(_endpoint(dp), "m")
    other_model = WorkerAdapter(_endpoint(dp), "other", transfer_mode="engine_driven")
    try:
        eng.register_kv_caches(src)
        assert eng.store(tokens, blocks)
        shm = allocate_kv_caches(LAYERS, BLOCKS, BS, HEADS, HD, torch.bfloat16)
        srv.register_kv_caches(shm)
        assert srv.retrieve(tokens, blocks + 20) == 4 * CHUNK
        for x, y in zip(
            _tokens_view(src, blocks, 4 * CHUNK), _tokens_view(shm, blocks + 20, 4 * CHUNK), strict=True
        ):
            assert torch.equal(x, y)
        other_model.register_kv_caches(_separate())
        assert other_model.lookup(tokens) == 0
        assert other_model.retrieve(tokens, blocks) == 0
    finally:
        eng.close()
        srv.close()
        other_model.close()


def test_engine_pool_segment_is_released_on_close(dp: DataPlane) -> None:
    a = WorkerAdapter(_endpoint(dp), "m", transfer_mode="engine_driven")
    a.register_kv_caches(_separate())
    seg = dp.engine.registry.context_entries_snapshot()[0]
    assert seg.transfer_mode == "engine_driven"
    with dp.engine.registry.use(a.instance_id) as entry:
        names = [e.segment.name for e in [entry.strategy] if e]
    assert names and all(os.path.exists(shm.SHM_DIR / n) for n in names)
    a.close()
    assert all(not os.path.exists(shm.SHM_DIR / n) for n in names)
    assert dp.engine.registry.tracked_instance_count() == 0
