"""A server process that dies (SIGKILL) costs a worker a miss, never the request timeout.

The adapter runs with ``request_timeout`` 30 s and a heartbeat of about a second: a transfer
that waited for a dead server, or raised, would show at once. Each transfer must return the
miss without waiting out the request timeout (the outage's one WARNING names why the first
missed), the ones after it without sending a request at all; count it in ``misses``, log one
WARNING for the whole outage, and once a new server is up on the same port the adapter
recovers by itself.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from tests.conftest import ServerFactory
from tests.helpers import ServerProcess, wait_until

CHUNK = 32
ARGS = ("--chunk-size", str(CHUNK), "--l1-size-gb", "0.05")
N_TOKENS = 32 * CHUNK  # a RETRIEVE of 4 KiB of token ids: far above any PING in a socket queue
TOKENS = np.arange(N_TOKENS)
SRC, DST = np.arange(N_TOKENS // 16), np.arange(N_TOKENS // 16, N_TOKENS // 8)
HB = 1.0
TIMEOUT = 30.0
RECOVER = 20.0  # a new server's start plus a few heartbeats, on a slow shared 2-core machine
Caches = list[torch.Tensor]
Call = Callable[[WorkerAdapter], object]
CALLS: dict[str, tuple[Call, object]] = {
    "store": (lambda w: w.store(TOKENS, SRC), False),
    "lookup": (lambda w: w.lookup(TOKENS), 0),
    "retrieve": (lambda w: w.retrieve(TOKENS, DST), 0),
}


@pytest.fixture
def caches() -> Iterator[Caches]:
    c = allocate_kv_caches(2, N_TOKENS // 8, 16, 2, 8, torch.bfloat16)
    yield c
    free_kv_caches(c)


@pytest.fixture
def server(make_server: ServerFactory) -> Iterator[ServerProcess]:
    s = make_server(*ARGS)
    yield s
    if s.proc.poll() is None:
        os.kill(s.proc.pid, signal.SIGCONT)  # a stopped server would only die by SIGKILL


def kill(srv: ServerProcess) -> None:
    srv.proc.kill()
    srv.proc.wait(10)


def restart(make_server: ServerFactory, old: ServerProcess) -> ServerProcess:
    """A new server on ``old``'s port (the last ``--port`` wins)."""
    srv = make_server(*ARGS, "--port", str(old.port), ready=False)
    srv.port, srv.endpoint = old.port, old.endpoint
    srv.wait_ready()
    return srv


def queued_at(port: int) -> int:
    """The most bytes waiting unread in one connection to local ``port``: a stopped server
    reads nothing, so what a client sent it stays in the kernel's receive queue."""
    most = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == port:  # ESTABLISHED, server side
            most = max(most, int(f[4].split(":")[1], 16))
    return most


def stopped(pid: int) -> bool:
    """Every thread of ``pid`` stopped (SIGSTOP takes effect a moment after it is sent)."""
    states = [
        (t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()
    ]
    return all(s == "T" for s in states)


def outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "dataplane.client.adapter" and r.levelno == logging.WARNING
    ]


def sent_requests(w: WorkerAdapter, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The types of the requests ``w`` sends on its transfer channel from now on."""
    sent: list[str] = []
    request = w._chan.request

    def spy(msg: Any, *args: Any, **kwargs: Any) -> Any:
        sent.append(str(msg.TYPE))
        return request(msg, *args, **kwargs)

    monkeypatch.setattr(w._chan, "request", spy)
    return sent


def served_again(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "served again" in r.getMessage()]


def round_trip(w: WorkerAdapter, caches: Caches) -> None:
    """Store a pattern, wipe the destination blocks, retrieve it: byte-equal."""
    g = torch.Generator().manual_seed(3)
    for layer in caches:
        layer[:, SRC] = torch.randn(layer[:, SRC].shape, generator=g).to(layer.dtype)
        layer[:, DST] = 0
    assert w.store(TOKENS, SRC)
    assert w.retrieve(TOKENS, DST) == N_TOKENS
    for layer in caches:
        assert torch.equal(layer[:, DST].view(torch.int16), layer[:, SRC].view(torch.int16))


def recovers(w: WorkerAdapter, caches: Caches, caplog: pytest.LogCaptureFixture) -> None:
    """Healthy again by itself, registered with the new server, transfers served."""
    wait_until(lambda: w.is_healthy and w.registrations == 2, RECOVER, what="recovery")
    misses = w.misses
    round_trip(w, caches)
    assert w.misses == misses
    assert len(served_again(caplog)) == 1
    assert len(outage_warnings(caplog)) == 1  # still the one of the outage


@pytest.mark.parametrize("first", list(CALLS))
def test_transfers_after_the_server_died_are_prompt_misses(
    make_server: ServerFactory,
    server: ServerProcess,
    caches: Caches,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    first: str,
) -> None:
    caplog.set_level(logging.INFO, "dataplane.client")
    w = WorkerAdapter(server.endpoint, "m", heartbeat_interval=HB, request_timeout=TIMEOUT)
    try:
        w.register_kv_caches(caches)
        assert w.store(TOKENS, SRC)
        kill(server)  # no connection any more; the heartbeat has not noticed yet
        sent = sent_requests(w, monkeypatch)
        order = [first, *(c for c in CALLS if c != first)]
        for i, name in enumerate(order):
            fn, miss = CALLS[name]
            assert fn(w) == miss, name
            if i == 0:  # it may have tried (then health was cleared at once) ...
                tried = len(sent)
        assert len(sent) == tried <= 1, sent  # ... the others never sent a request
        assert w.misses == 3
        # one per outage, not one per request; the first miss waited for a connection at most
        # reconnect_wait_s (the heartbeat), or saw it closed: never the 30 s request timeout
        [warning] = outage_warnings(caplog)
        assert f"within {TIMEOUT:g}s" not in warning, warning
        assert served_again(caplog) == []
        restart(make_server, server)
        recovers(w, caches, caplog)
    finally:
        w.close()


def test_a_retrieve_in_flight_when_the_server_dies_is_a_prompt_miss(
    make_server: ServerFactory,
    server: ServerProcess,
    caches: Caches,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, "dataplane.client")
    # A heartbeat of 5 s: the heartbeat cannot notice the frozen server below before a PING
    # waited 5 s for its reply, while the kill comes some milliseconds after the freeze. What
    # ended the retrieve is in the outage's WARNING: "connection to the server closed" (the
    # closed connection), not "abandoned, the server is unhealthy" (the heartbeat, the old
    # behaviour) nor "no reply within 30s".
    hb = 5.0
    w = WorkerAdapter(server.endpoint, "m", heartbeat_interval=hb, request_timeout=TIMEOUT)
    got: list[object] = []
    ended = threading.Event()

    def retrieve() -> None:
        try:
            got.append(w.retrieve(TOKENS, DST))
        except BaseException as exc:
            got.append(exc)
        ended.set()

    try:
        w.register_kv_caches(caches)
        assert w.store(TOKENS, SRC)
        os.kill(server.proc.pid, signal.SIGSTOP)  # holds the RETRIEVE in flight, unanswered
        wait_until(lambda: stopped(server.proc.pid), 5, what="the server to stop")
        threading.Thread(target=retrieve, daemon=True).start()
        wait_until(lambda: queued_at(server.port) >= 4 * N_TOKENS, 10, what="the RETRIEVE sent")
        assert not ended.is_set()  # in flight: the frozen server answers nothing
        kill(server)  # the peer closes the connection the RETRIEVE went out on
        assert ended.wait(TIMEOUT / 2), "the in-flight retrieve did not end"  # a guard
        assert got == [0]
        assert w.misses == 1
        [warning] = outage_warnings(caplog)
        assert warning.endswith("(RETRIEVE: connection to the server closed)"), warning
        assert not w.is_healthy  # the lost connection cleared health at once
        sent = sent_requests(w, monkeypatch)
        assert w.lookup(TOKENS) == 0 and w.misses == 2  # answered at once, not logged again
        assert sent == []  # no request went out
        assert len(outage_warnings(caplog)) == 1
        restart(make_server, server)
        recovers(w, caches, caplog)
    finally:
        w.close()
