"""A transfer in flight when the server freezes is abandoned as soon as the heartbeat notices,
instead of holding the worker for the whole request timeout."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from tests.conftest import ServerFactory
from tests.helpers import ServerProcess, wait_until

CHUNK = 32


@pytest.fixture
def server(make_server: ServerFactory) -> Iterator[ServerProcess]:
    s = make_server("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
    yield s
    os.kill(s.proc.pid, signal.SIGCONT)  # a stopped server would only die by SIGKILL


def test_frozen_server_transfer_returns_a_miss_not_a_hang(server: ServerProcess) -> None:
    caches = allocate_kv_caches(2, 16, 16, 2, 8, torch.bfloat16)
    w = WorkerAdapter(server.endpoint, "m", heartbeat_interval=0.3, request_timeout=30.0)
    try:
        w.register_kv_caches(caches)
        tokens, blocks = np.arange(4 * CHUNK), np.arange(8)
        assert w.store(tokens, blocks)
        os.kill(server.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert w.retrieve(tokens, blocks) == 0  # in flight when the heartbeat gives up
        took = time.monotonic() - t0
        assert took < 5.0, f"retrieve held the worker {took:.1f}s (request timeout 30s)"
        assert not w.is_healthy
        assert w.store(tokens, blocks) is False  # dropped at once while unhealthy
        os.kill(server.proc.pid, signal.SIGCONT)
        wait_until(lambda: w.is_healthy, 10, what="recovery after SIGCONT")
        assert w.lookup(tokens) == 4 * CHUNK
        # the server kept us: recovery sent one REGISTER, answered as a no-op refresh
        assert (w.registrations, w.refreshes) == (1, 1)
    finally:
        w.close()
        free_kv_caches(caches)
