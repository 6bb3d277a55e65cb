"""A transfer in flight when the server freezes is abandoned as soon as the heartbeat notices,
instead of holding the worker for the whole request timeout."""

from __future__ import annotations

import logging
import os
import signal
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


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped): a SIGSTOP takes effect asynchronously."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_frozen_server_transfer_returns_a_miss_not_a_hang(
    server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    caches = allocate_kv_caches(2, 16, 16, 2, 8, torch.bfloat16)
    w = WorkerAdapter(server.endpoint, "m", heartbeat_interval=0.3, request_timeout=30.0)
    try:
        w.register_kv_caches(caches)
        tokens, blocks = np.arange(4 * CHUNK), np.arange(8)
        assert w.store(tokens, blocks)
        os.kill(server.proc.pid, signal.SIGSTOP)
        wait_until(lambda: _state(server.proc.pid) == "T", 10, 0.005, what="the server stopped")
        with caplog.at_level(logging.WARNING, "dataplane.client.adapter"):
            assert w.retrieve(tokens, blocks) == 0  # in flight when the heartbeat gives up
        # abandoned because the heartbeat declared the server unhealthy ("RETRIEVE: abandoned,
        # the server is unhealthy"), never by waiting out the 30 s request timeout ("no reply
        # within 30s"): the first miss of an outage logs its reason
        (why,) = [r.getMessage() for r in caplog.records if "transfers answer as misses" in r.getMessage()]
        assert why.endswith("the server is unhealthy)"), why
        assert not w.is_healthy and w.misses == 1
        assert w.store(tokens, blocks) is False  # dropped at once while unhealthy
        assert w.misses == 2
        os.kill(server.proc.pid, signal.SIGCONT)
        wait_until(lambda: w.is_healthy, 10, what="recovery after SIGCONT")
        assert w.lookup(tokens) == 4 * CHUNK
        # the server kept us: recovery sent one REGISTER, answered as a no-op refresh
        assert (w.registrations, w.refreshes) == (1, 1)
    finally:
        w.close()
        free_kv_caches(caches)
