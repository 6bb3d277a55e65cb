"""Fixtures of the bad-input tests: a real server process (one per module), a worker registered
with it, and a raw DEALER socket to it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from tests.dataplane.server.wire_client import CHUNK, LAYOUT, MAX_FRAME, Sock
from tests.helpers import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("bad-input"),
        "--max-frame-bytes",
        str(MAX_FRAME),
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "0.01",
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        rc = srv.stop()
        assert rc == 0, f"server exited {rc}:\n{srv.output()}"
        assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture(scope="module")
def worker(server: ServerProcess) -> Iterator[tuple[WorkerAdapter, list[torch.Tensor]]]:
    caches = allocate_kv_caches(**LAYOUT)  # type: ignore[arg-type]
    for c in caches:
        c.copy_(torch.randn(c.shape).to(c.dtype))
    w = WorkerAdapter(server.endpoint, model_name="bad-input", request_timeout=10.0)
    w.register_kv_caches(caches)
    yield w, caches
    w.close()


@pytest.fixture
def sock(server: ServerProcess, make_dealer: Callable[[str], Sock]) -> Sock:
    return make_dealer(server.endpoint)
