"""Process helpers the benchmarks share: free ports, a server process (its ZMQ endpoint and its
sidecar's URL), readiness polled with a deadline, the sidecar's JSON, a process's memory."""

from __future__ import annotations

import collections
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from dataplane.wire.messages import Ping
from dataplane.wire.protocol import decode_reply, encode_message

_GIVEN: collections.deque[int] = collections.deque(maxlen=256)  # ports handed out lately
_given_lock = threading.Lock()  # guards _GIVEN


def _below_ephemeral() -> tuple[int, int] | None:
    """Ports under the kernel's ephemeral range (where outgoing connections take their own
    port from), from 10000; None where that leaves fewer than 1000."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (10_000, low) if low - 10_000 >= 1000 else None


def _this_worker(span: tuple[int, int] | None) -> tuple[int, int] | None:
    """Of ``span``, this test worker's share (pytest-xdist's ``PYTEST_XDIST_WORKER`` gwN of
    ``PYTEST_XDIST_WORKER_COUNT``): workers never hand out the same port, so a port given to an
    engine that binds it only after a slow start is not another worker's server's meanwhile."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if span is None or not worker.startswith("gw") or not worker[2:].isdigit() or not count.isdigit():
        return span
    n, i = int(count), int(worker[2:])
    width = (span[1] - span[0]) // max(1, n)
    return span if width < 1000 or i >= n else (span[0] + i * width, span[0] + (i + 1) * width)


_RANGE = _this_worker(_below_ephemeral())
_rng = random.Random()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, and not one this process handed
    out lately: two calls in a row (a server's data plane and sidecar ports, neither bound yet)
    never get the same port, as the kernel may hand back a port it just gave. Taken under the
    ephemeral range where there is room: a server restarted on its port must find it free, and
    an ephemeral port may meanwhile be any outgoing connection's own."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", 0 if _RANGE is None else _rng.randrange(*_RANGE)))
            except OSError:
                continue  # (in use: another one)
            port = int(s.getsockname()[1])
        with _given_lock:
            if port not in _GIVEN:
                _GIVEN.append(port)
                return port


def serve_command(*args: str) -> list[str]:
    """``kvwarden serve`` with ``args``, run by this interpreter."""
    return [sys.executable, "-m", "app.cli", "serve", *args]


def bench_env() -> dict[str, str]:
    """This environment without an admin token: a benchmark's server needs none."""
    return {k: v for k, v in os.environ.items() if k != "KVWARDEN_ADMIN_TOKEN"}


@dataclass
class BenchServer:
    """A ``kvwarden serve`` process on free ports."""

    proc: subprocess.Popen[bytes]
    endpoint: str  # the data plane, tcp://127.0.0.1:PORT
    url: str  # the HTTP sidecar, http://127.0.0.1:PORT
    started: float  # time.perf_counter() just before the process was started

    def get(self, path: str, timeout_s: float = 30.0) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            body: bytes = r.read()
        return body

    def json(self, path: str, timeout_s: float = 30.0) -> Any:
        return json.loads(self.get(path, timeout_s))

    def stop(self) -> None:
        stop_process(self.proc)


def launch(*args: str, env: dict[str, str] | None = None, own_session: bool = False) -> BenchServer:
    """Start ``kvwarden serve`` with ``args`` on free ports (not waiting for it). Its standard
    output (the "serving on" line) is dropped, so a benchmark's own output stays clean; its
    warnings and errors still reach standard error. ``own_session``: in a session of its own,
    so the kernel's autogroup scheduler shares the CPU between it and the benchmark's
    client as between two services (`kvbench.serve.stack`)."""
    port, http_port = free_port(), free_port()
    cmd = serve_command("--port", str(port), "--http-port", str(http_port), "--log-level", "warning", *args)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=bench_env() if env is None else env, stdout=subprocess.DEVNULL, start_new_session=own_session
    )
    return BenchServer(proc, f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", t0)


def launch_pinged(*args: str) -> tuple[BenchServer, float]:
    """`launch`, with a PING queued for the server before it binds: the server and the seconds
    from its start to that PING answered. RuntimeError (the server stopped) when it exits,
    refuses the PING or has not answered it in 60 s."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RECONNECT_IVL, 2)  # ms: the first connect after the bind is seen at once
    sock.setsockopt(zmq.LINGER, 0)
    server = launch(*args)
    try:
        sock.connect(server.endpoint)
        sock.send(encode_message(7, Ping(None, None)))  # queued until the connection is up
        deadline = time.monotonic() + 60
        while not sock.poll(5):
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not answer PING")
        first_ping = time.perf_counter() - server.started
        if not decode_reply(sock.recv()).ok:
            raise RuntimeError("the first PING was refused")
        return server, first_ping
    except BaseException:
        server.stop()
        raise
    finally:
        sock.close(linger=0)
        ctx.term()


def wait_ready(probe: Callable[[], Any], proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Call ``probe`` until it returns without raising; RuntimeError when ``proc`` exits or the
    deadline passes first."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            probe()
            return
        except Exception:
            pause.wait(0.02)
    raise RuntimeError("server did not answer in time")


def wait_server(proc: subprocess.Popen[Any], endpoint: str, timeout_s: float = 60.0) -> None:
    """Until the server at ``endpoint`` answers HELLO."""
    from dataplane.client import WorkerAdapter

    def hello() -> None:
        w = WorkerAdapter(endpoint, "bench-probe", request_timeout=0.5)
        try:
            w.server_info()
        finally:
            w.close()

    wait_ready(hello, proc, timeout_s)


def wait_http(server: BenchServer, path: str = "/livez", timeout_s: float = 60.0) -> None:
    """Until the sidecar answers ``path``."""
    wait_ready(lambda: server.get(path, 2.0), server.proc, timeout_s)


def wait_arena_ready(server: BenchServer, timeout_s: float = 120.0) -> dict[str, Any]:
    """Until `/status` says L1's arena is reserved and faulted in; the arena's view then."""

    def ready() -> None:
        if not arena_view(server).get("ready"):
            raise RuntimeError("arena not ready yet")

    wait_ready(ready, server.proc, timeout_s)
    return arena_view(server)


def arena_view(server: BenchServer) -> dict[str, Any]:
    """`/status`'s ``storage.l1.arena`` (empty when the server shows none)."""
    a = server.json("/status")["storage"]["l1"].get("arena")
    return dict(a) if a else {}


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 15.0) -> None:
    """SIGTERM (the server drains and exits), SIGKILL if it has not within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def memory_of(pid: int) -> dict[str, int]:
    """Resident memory of ``pid`` in bytes (``VmRSS`` and its anonymous, file and shared-memory
    parts) and the bytes its segments occupy in the shared-memory directory."""
    from dataplane.memory.shm import PREFIX, SHM_DIR

    out: dict[str, int] = {}
    keys = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem"}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            out[keys[key] + "_bytes"] = int(value.split()[0]) * 1024
    used = 0
    for entry in SHM_DIR.glob(f"{PREFIX}{pid}-*"):
        try:
            used += entry.stat().st_blocks * 512
        except OSError:  # unlinked meanwhile
            continue
    out["shm_bytes"] = used
    return out


def drained(server: BenchServer, n: int, timeout_s: float = 120.0) -> None:
    """Wait (polling, ``timeout_s`` at most) until ``n`` chunks reached the server's remote
    tier; RuntimeError when writes were lost or the time ran out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = server.json("/status")["storage"]["remote"]
        if r["puts"] >= n:
            return
        if r["dropped_writes"] or r["put_failures"]:
            raise RuntimeError(f"bench: writes to Redis lost: {r}")
        time.sleep(0.05)  # polling a real process, under a deadline
    raise RuntimeError(f"bench: {n} chunks did not reach Redis in {timeout_s:.0f} s")
