"""In-process sidecar tests: a real data plane (real ZMQ sockets, real pools and reaper) and the
real app over it, served by the real `Sidecar` (uvicorn on a free port) and driven over HTTP with
httpx; workers are real `WorkerAdapter`s whose KV caches live in real shared memory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import SecretStr

from app.main import create_app
from app.server import Sidecar
from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.server.config import Settings
from dataplane.server.facade import DataPlaneView
from dataplane.server.runtime import DataPlane, build_dataplane
from tests.helpers import free_port

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHUNK = 16  # tokens per chunk: the tiny layout below holds 8 blocks x 16 tokens
LAYOUT = (2, 8, 16, 2, 8)  # layers, blocks, block size, kv heads, head dim

DataPlaneFactory = Callable[..., DataPlane]


@pytest.fixture
def make_dp() -> Iterator[DataPlaneFactory]:
    """Started data planes on free ports (settings overridable); all stopped at teardown."""
    made: list[DataPlane] = []

    def make(**overrides: Any) -> DataPlane:
        fields: dict[str, Any] = {
            "port": free_port(),
            "http_port": free_port(),
            "chunk_size": CHUNK,
            "l1_size_gb": 0.125,  # the arena is reserved and faulted in at start: keep it small
            "admin_token": SecretStr(TOKEN),
        }
        fields.update(overrides)
        dp = build_dataplane(Settings(**fields))
        made.append(dp)
        dp.start()
        return dp

    yield make
    for dp in made:
        assert dp.stop(), "data plane did not stop within its bound"


@pytest.fixture
def dp(make_dp: DataPlaneFactory) -> DataPlane:
    return make_dp()


AppFactory = Callable[..., httpx.Client]


@pytest.fixture
def serve_app() -> Iterator[AppFactory]:
    """Serve ``create_app(dp, ...)`` on a real socket; returns an httpx client for it."""
    running: list[tuple[Sidecar, httpx.Client]] = []

    def serve(dp: DataPlaneView, **app_kw: Any) -> httpx.Client:
        sidecar = Sidecar(dp, host="127.0.0.1", port=0, app=create_app(dp, **app_kw))
        sidecar.start()
        c = httpx.Client(base_url=sidecar.url, timeout=30.0)
        running.append((sidecar, c))
        return c

    yield serve
    for sidecar, c in running:
        c.close()
        assert sidecar.stop(), "sidecar did not stop within its bound"


@pytest.fixture
def client(dp: DataPlane, serve_app: AppFactory) -> httpx.Client:
    return serve_app(dp)


class Worker:
    """A registered WorkerAdapter and its caches (all in this process)."""

    def __init__(self, adapter: WorkerAdapter, caches: list[torch.Tensor]) -> None:
        self.adapter = adapter
        self.caches = caches

    @property
    def id(self) -> int:
        return self.adapter.instance_id

    @property
    def segment(self) -> str:
        from dataplane.memory.shm import SHM_DIR

        return str(SHM_DIR / self.adapter.segments[0])


WorkerFactory = Callable[..., Worker]


@pytest.fixture
def make_worker(dp: DataPlane) -> Iterator[WorkerFactory]:
    """Registered workers on ``dp``; a long heartbeat unless asked (tests drive
    ``heartbeat_once`` themselves when they need a PING). Closed at teardown."""
    made: list[WorkerAdapter] = []

    def make(model: str = "m", heartbeat_interval: float = 10.0, **kw: Any) -> Worker:
        w = WorkerAdapter(
            dp.server.bound_endpoint,
            model_name=model,
            heartbeat_interval=heartbeat_interval,
            request_timeout=10.0,
            **kw,
        )
        made.append(w)
        caches = allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16)
        w.register_kv_caches(caches)
        return Worker(w, caches)

    yield make
    for w in made:
        w.close()


def mappings_of(path: str) -> int:
    """How many mappings of ``path`` this process holds (worker's and server's alike)."""
    return sum(
        1
        for line in Path("/proc/self/maps").read_text().splitlines()
        if line.endswith(path) or line.endswith(path + " (deleted)")
    )
