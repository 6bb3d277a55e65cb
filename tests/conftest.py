from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.helpers import ServerProcess, dealer
from tests.redis_server import RedisServer

DealerFactory = Callable[[str], zmq.Socket[Any]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow suites (soak) run only with KVWARDEN_SLOW=1; otherwise they are deselected (not
    skipped: they are not part of the default run at all). Tests marked ``bench`` (measurements:
    wall-clock bounds) likewise run only with KVWARDEN_BENCH=1 or a ``-m`` expression naming
    ``bench``, wherever they are (tests/kvbench/conftest.py does the same for its own directory)."""
    if not (os.environ.get("KVWARDEN_BENCH") or "bench" in str(config.getoption("markexpr") or "")):
        bench = [i for i in items if i.get_closest_marker("bench")]
        if bench:
            config.hook.pytest_deselected(items=bench)
            items[:] = [i for i in items if not i.get_closest_marker("bench")]
    # the vLLM group first: under `--dist loadgroup` it is one unit of work, the longest, and
    # one worker starts on it at once while the other takes every other module, instead of
    # meeting it halfway through the run (a stable sort: the rest keep their order)
    items.sort(key=lambda i: _group(i) != "vllm")
    if os.environ.get("KVWARDEN_SLOW"):
        return
    slow = [i for i in items if i.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if not i.get_closest_marker("slow")]


def _group(item: pytest.Item) -> str | None:
    m = item.get_closest_marker("xdist_group")
    return None if m is None else str(m.args[0] if m.args else m.kwargs.get("name"))


@pytest.hookimpl(tryfirst=True)
def pytest_itemcollected(item: pytest.Item) -> None:
    """Under ``make test``'s two workers (pytest-xdist, ``--dist loadgroup``) a module's tests run
    on one worker, so a module-scoped fixture (a server, ``bench all --tiny``) starts once, not
    once per worker; the vLLM tests share one group across their modules (``xdist_group("vllm")``)."""
    if item.get_closest_marker("xdist_group") is None:
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


ServerFactory = Callable[..., ServerProcess]


@pytest.fixture
def make_dealer() -> Iterator[DealerFactory]:
    """Raw DEALER sockets on one context; all closed with linger=0, then the context terminates."""
    ctx: zmq.Context[Any] = zmq.Context()
    socks: list[zmq.Socket[Any]] = []

    def make(endpoint: str) -> zmq.Socket[Any]:
        s = dealer(ctx, endpoint)
        socks.append(s)
        return s

    yield make
    for s in socks:
        s.close(linger=0)
    ctx.term()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """Start real `kvwarden serve` processes; every one is stopped at teardown."""
    servers: list[ServerProcess] = []

    def make(*args: str, ready: bool = True) -> ServerProcess:
        srv = ServerProcess(tmp_path / "server", *args)
        servers.append(srv)
        if ready:
            srv.wait_ready()
        return srv

    yield make
    for srv in servers:
        srv.stop()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server of the test's own, on a free loopback port; stopped afterwards."""
    r = RedisServer()
    try:
        yield r
    finally:
        r.stop()
