"""Fixtures of the flood tests (`tests.reliability.test_registration_floods`,
`tests.reliability.test_connection_floods`); their bench is `tests.reliability.flood_bench`."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from dataplane.memory import shm
from tests.reliability.flood_bench import PAST_LIMIT
from tests.reliability.workers import private_shm_dir


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private segment directory for the server, the worker and this process's caches."""
    with private_shm_dir() as d:
        monkeypatch.setattr(shm, "SHM_DIR", d)
        yield d


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.bench)], ids=["answered", "timed"])
def timed(request: pytest.FixtureRequest) -> bool:
    """Whether the flood also asserts the answer times (PING_BOUND_S, LIVEZ_BOUND_S): a
    measurement, so that variant is a ``bench`` test."""
    return bool(request.param)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    """A context for the floods' sockets; this process's own soft limit on open files goes up for
    them (two descriptors a DEALER), and back at teardown."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * PAST_LIMIT + 1024
    assert hard == resource.RLIM_INFINITY or hard >= need, (
        f"the floods need {need} open files, hard limit {hard}"
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, need), hard))
    c: zmq.Context[Any] = zmq.Context()
    c.set(zmq.MAX_SOCKETS, 8192)  # the floods open more than libzmq's default of 1,023
    yield c
    c.destroy(linger=0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
