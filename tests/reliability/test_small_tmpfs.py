"""A real `kvwarden serve` whose segment directory (``KVWARDEN_SHM_DIR``) is a 64 MiB tmpfs.

Space is reserved when a segment is created, and a segment that is not fully allocated is never
mapped, so the server refuses what does not fit instead of dying of SIGBUS at the first copy
into a page the tmpfs cannot back: an engine-driven pool bigger than the free space gets
LIMIT_EXCEEDED, a sparse worker segment bigger than it gets INVALID_LAYOUT, and one that fits
works. The server answers after every refusal and exits 0 on SIGTERM.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter
from dataplane.memory import shm
from dataplane.memory.kvmemory import contiguous_strides
from dataplane.memory.shm import valid_segment_name
from dataplane.wire.errors import LimitExceeded
from dataplane.wire.messages import MemoryKind, Register, ShmLayer, TransferMode
from dataplane.wire.protocol import encode_message
from tests.conftest import DealerFactory
from tests.dataplane.registration import SECRET
from tests.helpers import (
    ServerProcess,
    call,
    error_of,
    mounted_tmpfs,
    new_name,
    next_rid,
    ping,
    subprocess_env,
)

MiB = 1 << 20
LAYERS, HEADS, HEAD_DIM, BLOCK = 4, 8, 64, 16
CHUNK = 256  # tokens a chunk (the server is told)
CHUNK_BYTES = LAYERS * 2 * CHUNK * HEADS * HEAD_DIM * 2  # 2 MiB: bfloat16


@pytest.fixture
def small_tmpfs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    with mounted_tmpfs("64m") as d:
        monkeypatch.setattr(shm, "SHM_DIR", d)  # where this process's adapters map the pools
        yield d


@pytest.fixture
def server(small_tmpfs: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path / "server", "--chunk-size", str(CHUNK), env=subprocess_env(KVWARDEN_SHM_DIR=str(small_tmpfs))
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()  # before the tmpfs goes: its pools live there


def free_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def engine_adapter(srv: ServerProcess, pool_chunks: int) -> WorkerAdapter:
    return WorkerAdapter(
        srv.endpoint, "m", transfer_mode="engine_driven", pool_chunks=pool_chunks, heartbeat_interval=5.0
    )


def local_caches(num_blocks: int) -> list[torch.Tensor]:
    """An engine's own KV tensors (ordinary memory: only the pool is shared)."""
    shape = (2, num_blocks, BLOCK, HEADS, HEAD_DIM)
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]


def round_trip(adapter: WorkerAdapter, caches: list[torch.Tensor]) -> None:
    want = [c.clone() for c in caches]
    tokens, blocks = np.arange(512) + 7, np.arange(32)
    assert adapter.store(tokens, blocks)
    for c in caches:
        c.zero_()
    assert adapter.retrieve(tokens, blocks) == 512
    assert all(torch.equal(a, b) for a, b in zip(caches, want, strict=True))


def sparse_registration(path: Path, layer_bytes: int) -> Register:
    """A two-layer REGISTER of the segment at ``path``, made sparse: its size, and no page."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 2 * layer_bytes)
    finally:
        os.close(fd)
    kv_shape = (2, layer_bytes // (2 * BLOCK * HEADS * HEAD_DIM * 2), BLOCK, HEADS, HEAD_DIM)
    strides = contiguous_strides(kv_shape)
    layers = (ShmLayer(path.name, 0, strides), ShmLayer(path.name, layer_bytes, strides))
    return Register(
        7,
        SECRET,
        "m",
        1,
        0,
        TransferMode.SERVER_DRIVEN,
        MemoryKind.SHM,
        "bfloat16",
        kv_shape,
        os.getpid(),
        layers,
    )


def test_small_segment_directory_refuses_what_does_not_fit(
    server: ServerProcess, small_tmpfs: Path, make_dealer: DealerFactory
) -> None:
    sock = make_dealer(server.endpoint)
    fits = engine_adapter(server, 16)  # 32 MiB of the 64
    try:
        caches = local_caches(32)
        fits.register_kv_caches(caches)
        round_trip(fits, caches)
        room = free_bytes(small_tmpfs)
        assert 8 * CHUNK_BYTES <= room < 24 * CHUNK_BYTES  # room for less than the next pool

        too_big = engine_adapter(server, 24)  # 48 MiB: below the tmpfs's size, above its room
        try:
            with pytest.raises(LimitExceeded) as info:
                too_big.register_kv_caches(local_caches(32))
        finally:
            too_big.close()
        assert f"{24 * CHUNK_BYTES} bytes in {small_tmpfs}" in str(info.value), str(info.value)
        assert "No space left on device" in str(info.value), str(info.value)
        assert free_bytes(small_tmpfs) == room  # the refused pool gave its room back
        left = [p.name for p in small_tmpfs.iterdir()]
        assert len(left) == 1 and valid_segment_name(left[0]), left  # the pool that fits, no temporary
        ping(sock)

        sparse = small_tmpfs / new_name()
        reg = sparse_registration(sparse, 24 * MiB)
        assert 48 * MiB > free_bytes(small_tmpfs)  # more than the room left
        code, message = error_of(call(sock, encode_message(next_rid(), reg)))
        assert code == "INVALID_LAYOUT", (code, message)
        assert message == (
            f"layer 0: segment {sparse.name} is sparse: 0 of {48 * MiB} bytes allocated; "
            "create it with posix_fallocate"
        )
        sparse.unlink()
        ping(sock)  # the server did not die of SIGBUS
        round_trip(fits, caches)
    finally:
        fits.close()
    assert server.proc.poll() is None, server.output()
    server.sigterm()
    assert server.proc.wait(30) == 0, server.output()
    assert "Traceback" not in server.output(), server.output()
