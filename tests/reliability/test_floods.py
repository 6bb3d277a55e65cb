"""Floods against a real `kvwarden serve` started with a soft limit of 1,024 open files.

A registration flood (REGISTERs of both transfer modes over one connection and over many) meets
``--max-instances-per-connection`` and ``--max-instances`` with LIMIT_EXCEEDED and leaves
nothing behind once the flooders go; a connection flood (hundreds of idle ZMQ connections and
hundreds of idle HTTP connections) costs one descriptor each and nothing else. During and after
each: a PING prober on its own connection keeps being answered (within a bound: the ``timed``
variant, a ``bench`` test), a real worker keeps
storing and retrieving, a new worker registers and stores, ``/livez`` answers, the log carries no
flood of tracebacks, and the server exits 0 on SIGTERM. A connection flood by another process
(`tests.reliability.flooder`), past ``--max-connections``, is refused connection by connection
and counted in /metrics while everyone connected before is served; a last test takes the hard
limit down to 1,024 too, so the server cannot raise its soft limit, and floods past it: the
connection cap keeps the flood from spending the descriptors.

The server is started through ``python -m tests.reliability.workers serve --nofile-soft 1024``,
which calls ``setrlimit(RLIMIT_NOFILE, (1024, hard))`` and execs ``python -m app.cli serve``.
Measurements are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import re
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from prometheus_client.parser import text_string_to_metric_families

from app import logs
from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.memory import shm
from dataplane.server.config import FD_KEEP
from dataplane.wire.errors import LimitExceeded
from dataplane.wire.messages import Ping, Unregister
from dataplane.wire.protocol import ReplyFrame, decode_reply, encode_message
from tests.dataplane.registration import engine_register_message, register_message, segment_of
from tests.helpers import ROOT, LineReader, subprocess_env, wait_until
from tests.reliability.workers import (
    CHUNK,
    Opts,
    Proc,
    Serve,
    env_for,
    http_get,
    private_shm_dir,
)

# The bounds on answer times are measurements: asserted only by the ``timed`` variant of each
# flood (marked ``bench``); the default one checks that everything was answered at all, its
# timeouts (PING_GUARD_S, LIVEZ_BOUND_S + 3) only guards against a server that never answers.
PING_BOUND_S = 0.5  # the slowest PING answer allowed during a flood (a loaded 2-core machine)
LIVEZ_BOUND_S = 2.0
PING_LATE_S = 2.0  # timed: a PING answered later is a miss
PING_GUARD_S = 8.0  # untimed: a PING unanswered this long is a miss (the server stopped answering)
PER_CONN = 32  # --max-instances-per-connection of the registration flood
MAX_INSTANCES = 200  # --max-instances of the registration flood
ZMQ_IDLE = 600
HTTP_IDLE = 300  # beyond the sidecar's 256 connections: /livez answers 503 until they are closed
PAST_LIMIT = 1100  # connections against a hard limit of 1,024
CAP = 48  # --max-connections of the connection-cap flood
CAP_FLOOD_ZMQ = 150  # its flooder's idle DEALERs: past the cap they reconnect, ten times a second
CAP_FLOOD_RAW = 150  # and raw TCP connections


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


def dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


_RID = iter(range(1, 1 << 62))


def send(sock: zmq.Socket[Any], msg: Any) -> int:
    rid = next(_RID)
    sock.send(encode_message(rid, msg))
    return rid


def replies(sock: zmq.Socket[Any], rids: list[int], timeout: float = 30.0) -> dict[int, ReplyFrame]:
    """The replies to ``rids`` (sent over ``sock``), by request id."""
    got: dict[int, ReplyFrame] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(rids):
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000), zmq.POLLIN), f"{len(got)} of {len(rids)} replies"
        r = decode_reply(sock.recv())
        got[r.request_id] = r
    return got


def code_of(r: ReplyFrame) -> str:
    return "OK" if r.ok else str(r.body["code"])


class Prober(threading.Thread):
    """PINGs (a probe: no instance) over a connection of its own, one every ``every_s`` (the
    pacing of a probe), recording each answer's time; an answer later than ``late_s`` counts
    as a miss."""

    def __init__(
        self, ctx: zmq.Context[Any], endpoint: str, every_s: float = 0.02, late_s: float = 2.0
    ) -> None:
        super().__init__(name="ping-prober", daemon=True)
        self.sock = dealer(ctx, endpoint)
        self.every_s, self.late_s = every_s, late_s
        self.rtts: list[float] = []
        self.misses = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            t0 = time.monotonic()
            rid = send(self.sock, Ping(None, None))
            while True:
                left = self.late_s - (time.monotonic() - t0)
                if left <= 0 or not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    self.misses += 1
                    break
                if decode_reply(self.sock.recv()).request_id == rid:
                    self.rtts.append(time.monotonic() - t0)
                    break

    def finish(self) -> tuple[int, float, float]:
        """(answers, median, slowest) in seconds."""
        self._halt.set()
        self.join(self.late_s + 10)
        if not self.sock.closed:
            self.sock.close(linger=0)
        s = sorted(self.rtts)
        return len(s), s[len(s) // 2], s[-1]


@dataclass
class Bench:
    server: Serve
    live: Proc  # a real worker process, registered before the flood
    prober: Prober
    base_fds: int
    timed: bool = False  # assert the answer times too (the bench variant)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        """Teardown: whatever is still running stops."""
        if self.prober.is_alive():
            self.prober.finish()
        self.live.stop()
        self.server.stop()

    def livez(self) -> tuple[int, float]:
        status, body, took = http_get(self.server.http_port, "/livez", LIVEZ_BOUND_S + 3)
        assert not self.timed or took <= LIVEZ_BOUND_S, took
        assert status == 503 or body == b'{"status":"pass"}', (status, body)
        return status, took

    def live_works(self, prompt: int) -> None:
        r = self.live.command("stored", op="store", prompt=prompt)["r"]
        assert r["chunks"] > 0 and r["rejected"] == 0 and r["stored"] + r["present"] == r["chunks"], r
        got = self.live.command("retrieved", op="retrieve", prompt=prompt)
        assert got["bad"] == [] and got["n"] == r["chunks"] * CHUNK, got

    def tracked(self) -> int:
        status, body, _ = http_get(self.server.http_port, "/status")
        assert status == 200, body
        return int(json.loads(body)["worker_liveness"]["tracked_instances"])


def nofile_of(pid: int) -> tuple[str, str]:
    """The soft and hard "Max open files" of ``pid``."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError(f"no open-files limit in /proc/{pid}/limits")


def start_bench(
    tmp: Path,
    shm_dir: Path,
    ctx: zmq.Context[Any],
    *args: str,
    hard: int | None = None,
    timed: bool = False,
) -> Bench:
    env = env_for(shm_dir)
    server = Serve(
        tmp,
        "--chunk-size",
        str(CHUNK),
        "--worker-disconnect-grace-seconds",
        "1",
        "--l1-size-gb",
        "0.05",
        *args,
        env=env,
        nofile=(1024, hard),
    )
    live = Proc(tmp, "live", "agent", Opts(server.endpoint, seed=1, prompts_seed=1, heartbeat=0.5), shm_dir)
    prober: Prober | None = None
    try:
        server.wait_ready()
        live.registered()
        soft, hard_now = (int(v) for v in nofile_of(server.proc.pid))
        if hard is None:  # the server raised its soft limit of 1,024 to the hard one, and said so
            assert soft == hard_now > 1024, (soft, hard_now)
            assert f"soft limit raised from 1024 to {soft}" in server.output(), server.output()
        else:
            assert soft == hard_now == hard, (soft, hard_now)
        prober = Prober(ctx, server.endpoint, late_s=PING_LATE_S if timed else PING_GUARD_S)
        prober.start()
        wait_until(lambda: prober is not None and prober.rtts, 10, what="a first PING answer")
        bench = Bench(server, live, prober, server.fds(), timed)
        bench.live_works(0)
    except BaseException:
        if prober is not None:
            prober.finish()
        live.stop()
        server.stop()
        raise
    return bench


ACCEPT_ERROR = "ERROR asyncio: socket.accept() out of system resource"
SUPPRESSED = re.compile(r"suppressed (\d+) similar messages: (.*)")


def end_bench(b: Bench, accept_errors: bool = False) -> None:
    """The prober's PINGs were all answered (timed: in time), the worker closes, the server
    exits 0 on SIGTERM and its log holds no traceback; with ``accept_errors``, none but those
    of asyncio's ERROR records (a refused accept, and the retries it scheduled) that the log's
    rate limiter (`app.logs`) let through: at most its burst per kind and window."""
    n, p50, worst = b.prober.finish()
    assert b.prober.misses == 0, (b.prober.misses, b.prober.late_s)
    assert not b.timed or worst <= PING_BOUND_S, worst
    assert b.live.finish() == 0, b.live.log()
    t0 = time.monotonic()
    b.server.sigterm()
    rc = b.server.proc.wait(30)
    out = b.server.output()
    assert rc == 0, out
    tracebacks = out.count("Traceback")
    asyncio_errors = len(re.findall(r"ERROR asyncio: (?!suppressed \d+ similar)", out))
    assert tracebacks == (asyncio_errors if accept_errors else 0), out
    windows = 1 + int((time.monotonic() - b.started) // logs.DEFAULT_WINDOW_S)
    burst = logs.DEFAULT_BURST * windows  # of each kind: the refused accepts, the retries
    assert out.count(ACCEPT_ERROR) <= burst and tracebacks <= 2 * burst, out
    suppressed = {m.group(2)[:60]: int(m.group(1)) for m in SUPPRESSED.finditer(out)}
    b.notes.append(
        f"PING x{n}: median {p50 * 1000:.1f} ms, slowest {worst * 1000:.1f} ms; log {len(out.splitlines())} "
        f"lines, {tracebacks} tracebacks, suppressed {suppressed}; SIGTERM exit {rc} in "
        f"{time.monotonic() - t0:.2f}s"
    )
    print("\n" + "\n".join(b.notes))


def new_worker_works(endpoint: str, mode: str = "server_driven") -> None:
    """A fresh WorkerAdapter (in this process) registers, stores, retrieves and closes."""
    caches = allocate_kv_caches(2, 8, 16, 2, 8, torch.bfloat16)
    w = WorkerAdapter(
        endpoint, model_name="flood-check", heartbeat_interval=1.0, request_timeout=10.0, transfer_mode=mode
    )
    try:
        w.register_kv_caches(caches)
        tokens = list(range(4 * CHUNK))
        assert w.store(tokens, list(range(8)))
        assert w.retrieve(tokens, list(range(8))) == 4 * CHUNK
    finally:
        w.close()


# ------------------------------------------------------------------ registration flood


def register_over(sock: zmq.Socket[Any], caches: list[torch.Tensor], n: int) -> dict[int, tuple[int, bytes]]:
    """Send ``n`` REGISTERs over ``sock``, server-driven and engine-driven in turn, each a new id
    with its own secret; returns request id -> (instance id, secret)."""
    sent = {}
    for k in range(n):
        iid, secret = secrets.randbits(63), secrets.token_bytes(16)
        if k % 2:
            msg: Any = engine_register_message(iid, pool_chunks=1, secret=secret)
        else:
            msg = register_message(iid, caches, "flood", secret=secret)
        sent[send(sock, msg)] = (iid, secret)
    return sent


def flood(
    sock: zmq.Socket[Any], caches: list[torch.Tensor], n: int
) -> tuple[list[str], list[tuple[int, bytes]]]:
    """``n`` REGISTERs over ``sock``: every reply's code, and the instances admitted."""
    sent = register_over(sock, caches, n)
    got = replies(sock, list(sent))
    for r in got.values():  # a refusal names the limit it met
        assert r.ok or "max_instances" in r.body["message"], r
    return [code_of(r) for r in got.values()], [sent[rid] for rid, r in got.items() if r.ok]


def test_registration_flood_meets_the_instance_limits(
    tmp_path: Path, shm_dir: Path, ctx: zmq.Context[Any], timed: bool
) -> None:
    b = start_bench(
        tmp_path,
        shm_dir,
        ctx,
        "--max-instances",
        str(MAX_INSTANCES),
        "--max-instances-per-connection",
        str(PER_CONN),
        timed=timed,
    )
    caches = allocate_kv_caches(1, 2, 16, 1, 8, torch.bfloat16)  # the flood's one tiny cache
    socks: list[zmq.Socket[Any]] = []
    try:
        t0 = time.monotonic()
        # over one connection: the connection's limit answers beyond it
        one = dealer(ctx, b.server.endpoint)
        socks.append(one)
        codes, admitted = flood(one, caches, PER_CONN + 16)
        assert codes.count("OK") == PER_CONN and codes.count("LIMIT_EXCEEDED") == 16, codes
        # over many connections: the server's limit answers beyond it
        many = [dealer(ctx, b.server.endpoint) for _ in range(25)]
        socks += many
        codes = []
        for c, _ in [flood(s, caches, 10) for s in many]:
            codes += c
        flood_s = time.monotonic() - t0
        room = MAX_INSTANCES - 1 - PER_CONN  # the live worker holds one place
        assert codes.count("OK") == room and codes.count("LIMIT_EXCEEDED") == 250 - room, codes
        assert b.tracked() == MAX_INSTANCES
        peak_fds = b.server.fds()

        # at the limit: the registered worker works, /livez answers, a new worker is refused
        b.live_works(1)
        livez = b.livez()
        assert livez[0] == 200
        with pytest.raises(LimitExceeded):
            new_worker_works(b.server.endpoint)

        # the flooders go: half of one connection's instances unregister, the rest just close
        half = admitted[: PER_CONN // 2]
        got = replies(one, [send(one, Unregister(iid, sec)) for iid, sec in half])
        assert all(r.ok and r.body == {"removed": True} for r in got.values()), got
        t_close = time.monotonic()
        for s in socks:
            s.close(linger=0)
        wait_until(lambda: b.tracked() == 1, 15, what="every flood instance released")
        gone_s = time.monotonic() - t_close
        # their pools and mappings went with them
        wait_until(lambda: b.server.fds() <= b.base_fds + 2, 10, what="the server's descriptors back")
        left = sorted(
            p.name for p in shm_dir.iterdir() if not p.name.startswith(f"kvwarden-{b.server.proc.pid}-")
        )
        assert left == sorted([*b.live.info["segments"], segment_of(caches)]), left  # (and the L1 arena)
        new_worker_works(b.server.endpoint)
        new_worker_works(b.server.endpoint, "engine_driven")
        b.live_works(2)
        b.notes.append(
            f"registration flood: {PER_CONN + 16 + 250} REGISTERs in {flood_s:.2f}s, {MAX_INSTANCES} "
            f"tracked at the peak; server fds {b.base_fds} -> {peak_fds} -> {b.server.fds()}; all "
            f"released {gone_s:.2f}s after the close; /livez at the peak {livez[0]} in "
            f"{livez[1] * 1000:.0f} ms"
        )
        end_bench(b)
    finally:
        for s in socks:
            s.close(linger=0)
        b.close()


def test_registration_flood_past_the_descriptors_is_refused_not_fatal(
    tmp_path: Path, shm_dir: Path, ctx: zmq.Context[Any], timed: bool
) -> None:
    """A hard limit of 1,024 descriptors and the default --max-instances (4,096, far more than
    the descriptors can hold): registrations are refused with LIMIT_EXCEEDED naming the
    descriptors while the server keeps some free, so connections are still accepted."""
    b = start_bench(tmp_path, shm_dir, ctx, hard=1024, timed=timed)
    need = 2 * 4096 + (1024 - FD_KEEP) // 2 + 128  # the instances' descriptors, the cap's, the reserve
    assert f"below the {need} that max_instances 4096 beside max_connections" in b.server.output()
    caches = allocate_kv_caches(1, 2, 16, 1, 8, torch.bfloat16)
    socks = [dealer(ctx, b.server.endpoint) for _ in range(24)]
    try:
        codes: list[str] = []
        refusals: list[str] = []
        for s in socks:  # 24 x 48 REGISTERs: more than 1,024 descriptors could hold
            got = replies(s, list(register_over(s, caches, 48)))
            codes += [code_of(r) for r in got.values()]
            refusals += [r.body["message"] for r in got.values() if not r.ok]
        assert set(codes) == {"OK", "LIMIT_EXCEEDED"}, sorted(set(codes))
        assert all("file descriptors" in m for m in refusals), refusals[:3]
        assert b.server.fds() <= 1024 - 100  # the reserve was kept
        fresh = dealer(ctx, b.server.endpoint)  # a new connection is accepted and answered
        socks.append(fresh)
        assert replies(fresh, [send(fresh, Ping(None, None))])
        b.live_works(1)
        assert b.livez()[0] == 200
        for s in socks:
            s.close(linger=0)
        wait_until(lambda: b.tracked() == 1, 20, what="every flood instance released")
        new_worker_works(b.server.endpoint)
        b.notes.append(f"descriptor flood: {codes.count('OK')} admitted, {len(refusals)} refused")
        end_bench(b)
    finally:
        for s in socks:
            s.close(linger=0)
        b.close()


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
