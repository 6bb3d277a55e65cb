"""Connection floods against a real `kvwarden serve` started with a soft limit of 1,024 open
files (the bench: `tests.reliability.flood_bench`).

A connection flood (hundreds of idle ZMQ connections and hundreds of idle HTTP connections)
costs one descriptor each and nothing else. A connection flood by another process
(`tests.reliability.flooder`), past ``--max-connections``, is refused connection by connection
and counted in /metrics while everyone connected before is served; a last test takes the hard
limit down to 1,024 too, so the server cannot raise its soft limit, and floods past it: the
connection cap keeps the flood from spending the descriptors.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from prometheus_client.parser import text_string_to_metric_families

from dataplane.server.config import FD_KEEP
from tests.helpers import ROOT, LineReader, subprocess_env, wait_until
from tests.reliability.flood_bench import (
    LIVEZ_BOUND_S,
    PAST_LIMIT,
    Bench,
    dealer,
    end_bench,
    new_worker_works,
    start_bench,
)
from tests.reliability.workers import Serve, http_get

ZMQ_IDLE = 600
HTTP_IDLE = 300  # beyond the sidecar's 256 connections: /livez answers 503 until they are closed
CAP = 48  # --max-connections of the connection-cap flood
CAP_FLOOD_ZMQ = 150  # its flooder's idle DEALERs: past the cap they reconnect, ten times a second
CAP_FLOOD_RAW = 150  # and raw TCP connections

# -------------------------------------------------------------------- connection flood


def closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connection_flood_costs_a_descriptor_each_and_nothing_else(
    tmp_path: Path, shm_dir: Path, ctx: zmq.Context[Any], timed: bool
) -> None:
    b = start_bench(tmp_path, shm_dir, ctx, timed=timed)
    zsocks: list[zmq.Socket[Any]] = []
    hsocks: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        zsocks = [dealer(ctx, b.server.endpoint) for _ in range(ZMQ_IDLE)]
        hsocks = [socket.create_connection(("127.0.0.1", b.server.http_port)) for _ in range(HTTP_IDLE)]
        wait_until(
            lambda: b.server.fds() >= b.base_fds + ZMQ_IDLE + HTTP_IDLE, 30, what="every connection accepted"
        )
        t_open = time.monotonic()
        peak = b.server.fds()
        # during: the data plane does not care, /livez answers (503 beyond the HTTP limit)
        b.live_works(1)
        new_worker_works(b.server.endpoint)
        during = b.livez()
        # idle HTTP connections are closed by the server; then /livez passes again
        wait_until(lambda: all(closed_by_peer(s) for s in hsocks), 30, what="idle HTTP connections closed")
        http_closed_s = time.monotonic() - t_open
        after = b.livez()
        assert after[0] == 200
        for s in zsocks:
            s.close(linger=0)
        wait_until(lambda: b.server.fds() <= b.base_fds + 2, 15, what="the server's descriptors back")
        new_worker_works(b.server.endpoint, "engine_driven")
        b.live_works(2)
        b.notes.append(
            f"connection flood: {ZMQ_IDLE} ZMQ + {HTTP_IDLE} HTTP idle connections opened in "
            f"{t_open - t0:.2f}s; "
            f"server fds {b.base_fds} -> {peak} -> {b.server.fds()}; /livez during {during[0]} in "
            f"{during[1] * 1000:.0f} ms, after {after[0]} in {after[1] * 1000:.0f} ms; idle HTTP closed "
            f"{http_closed_s:.1f}s after the flood"
        )
        end_bench(b)
    finally:
        for s in zsocks:
            s.close(linger=0)
        for h in hsocks:
            h.close()
        b.close()


# ------------------------------------------------------------------- the connection cap


class Flooder:
    """A process of its own (`tests.reliability.flooder`) holding ``zmq`` idle DEALER connections
    and ``raw`` TCP connections to ``server`` until `let_go`."""

    def __init__(self, server: Serve, zmq_conns: int, raw_conns: int) -> None:
        cmd = [sys.executable, "-m", "tests.reliability.flooder", "127.0.0.1", str(server.port)]
        cmd += ["--zmq", str(zmq_conns), "--raw", str(raw_conns)]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=subprocess_env()
        )
        self.lines = LineReader(self.proc)
        try:
            assert self.lines.readline(60) == "open"
        except BaseException:
            self.stop()
            raise

    def let_go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        assert self.lines.readline(30) == "closed"
        assert self.proc.wait(30) == 0

    def stop(self) -> None:
        """Teardown: the process is gone and its pipes closed."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def metrics_of(b: Bench) -> dict[str, float]:
    """The server's /metrics samples without labels, by name; timed: answered within the /livez
    bound."""
    status, body, took = http_get(b.server.http_port, "/metrics", LIVEZ_BOUND_S + 3)
    assert status == 200, (status, took)
    assert not b.timed or took <= LIVEZ_BOUND_S, took
    return {
        s.name: s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
        if not s.labels
    }


def refused_at_once(port: int) -> bool:
    """A new TCP connection to ``port`` is closed by the server (its ZMTP greeting may come first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if s.recv(4096) == b"":
                    return True
            except ConnectionResetError:
                return True
            except TimeoutError:
                return False
    return False


def status_in_time(b: Bench) -> float:
    """/status answers (timed: within the /livez bound); its time."""
    status, body, took = http_get(b.server.http_port, "/status", LIVEZ_BOUND_S + 3)
    assert status == 200, (status, took, body[:200])
    assert not b.timed or took <= LIVEZ_BOUND_S, took
    return took


def hold_past_the_cap(b: Bench, cap: int, zmq_conns: int, raw_conns: int) -> tuple[Flooder, str]:
    """A flooder holds ``zmq_conns`` + ``raw_conns`` connections, more than ``cap``: the cap is
    reached, the rest are refused and counted, and the server's descriptors stay bounded.
    Returns the flooder and a note."""
    before = metrics_of(b)
    assert before["kvwarden_connections_max"] == cap and before["kvwarden_connections_refused_total"] == 0
    t0 = time.monotonic()
    flooder = Flooder(b.server, zmq_conns, raw_conns)
    past = zmq_conns + raw_conns - (cap - int(before["kvwarden_connections_open"]))
    try:
        wait_until(
            lambda: (
                (m := metrics_of(b))["kvwarden_connections_open"] == cap
                and m["kvwarden_connections_refused_total"] >= past
            ),
            60,
            what=f"the cap of {cap} reached and {past} connections refused",
        )
    except BaseException:
        flooder.stop()
        raise
    fds = b.server.fds()
    # (connections being refused hold a descriptor for a moment: a few, never the flood)
    assert fds <= b.base_fds + cap + 64, (fds, b.base_fds)
    return (
        flooder,
        f"{zmq_conns} ZMQ + {raw_conns} raw connections held in {time.monotonic() - t0:.2f}s, fds {fds}",
    )


def test_connections_past_max_connections_are_refused_and_counted(
    tmp_path: Path, shm_dir: Path, ctx: zmq.Context[Any], timed: bool
) -> None:
    """Another process holds far more connections than ``--max-connections``: the server serves
    that many, closes every other at once (a ZMQ client reconnects, and is refused again) and
    counts it; the worker and the prober connected before keep being served, /status answers,
    and once the flooder lets go a new worker connects and works."""
    b = start_bench(tmp_path, shm_dir, ctx, "--max-connections", str(CAP), timed=timed)
    flooder: Flooder | None = None
    try:
        base_open = metrics_of(b)["kvwarden_connections_open"]  # the worker's two, the prober's
        flooder, note = hold_past_the_cap(b, CAP, CAP_FLOOD_ZMQ, CAP_FLOOD_RAW)
        b.live_works(1)
        took = status_in_time(b)
        assert b.livez()[0] == 200
        assert refused_at_once(b.server.port)  # a new connection is closed before a message
        during = metrics_of(b)
        assert during["kvwarden_connections_open"] == CAP, during
        flooder.let_go()
        wait_until(
            lambda: metrics_of(b)["kvwarden_connections_open"] == base_open,
            15,
            what="the flood's connections gone",
        )
        refused = metrics_of(b)["kvwarden_connections_refused_total"]
        wait_until(lambda: b.server.fds() <= b.base_fds + 2, 15, what="the server's descriptors back")
        new_worker_works(b.server.endpoint)
        new_worker_works(b.server.endpoint, "engine_driven")
        b.live_works(2)
        status_in_time(b)
        after = metrics_of(b)
        assert after["kvwarden_connections_refused_total"] == refused, after  # nothing refused since
        assert after["kvwarden_connections_open"] == base_open, after
        out = b.server.output()
        assert f"connection(s) refused: {CAP} open, max_connections={CAP}" in out, out
        b.notes.append(
            f"connection cap {CAP}: {note}; {int(refused)} refused; /status during the flood in "
            f"{took * 1000:.0f} ms"
        )
        end_bench(b)
    finally:
        if flooder is not None:
            flooder.stop()
        b.close()


def test_a_connection_flood_past_a_hard_limit_of_1024_cannot_spend_the_descriptors(
    tmp_path: Path, shm_dir: Path, ctx: zmq.Context[Any], timed: bool
) -> None:
    """The soft and hard limits both 1,024, so the server cannot raise them: the default
    ``--max-connections`` is lowered to fit (and said so), and a flooder holding more connections
    than the limit itself spends none of the descriptors the rest needs: PINGs, a worker's
    transfers, /livez and /status are served throughout, and a new worker once it lets go."""
    b = start_bench(tmp_path, shm_dir, ctx, hard=1024, timed=timed)
    cap = (1024 - FD_KEEP) // 2
    assert f"max_connections: {cap} data-plane connections at most, not 1024" in b.server.output()
    flooder: Flooder | None = None
    try:
        flooder, note = hold_past_the_cap(b, cap, 100, PAST_LIMIT)
        assert b.server.fds() < 1024 - 128
        b.live_works(1)
        took = status_in_time(b)
        assert b.livez()[0] == 200  # (a new HTTP connection gets a descriptor)
        refused = metrics_of(b)["kvwarden_connections_refused_total"]
        flooder.let_go()
        wait_until(lambda: b.server.fds() <= b.base_fds + 2, 30, what="the flood's descriptors released")
        new_worker_works(b.server.endpoint)
        b.live_works(2)
        b.notes.append(
            f"past the limit: {note} (cap {cap}); {int(refused)} refused; /status during the flood in "
            f"{took * 1000:.0f} ms"
        )
        end_bench(b)
    finally:
        if flooder is not None:
            flooder.stop()
        b.close()
