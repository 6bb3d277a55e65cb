"""`kvwarden bench ping`: PING round trips through the server beside a raw ZMQ echo.

Both peers are separate processes, so the ratio isolates what the server adds (decode,
validate, touch, encode) to a bare DEALER -> ROUTER round trip. Samples alternate in rounds
so machine noise hits both alike. Then the same PING is measured while worker processes STORE
back to back (the transfer pool busy, the GIL contended).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

import zmq

from dataplane.wire.messages import Ping
from dataplane.wire.protocol import encode_message
from kvbench import report
from kvbench.procs import launch, wait_arena_ready, wait_http
from kvbench.results import add_output_args, finish, latency, resolve

_ECHO = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    m = s.recv_multipart()
    if m[-1] == b"quit":
        break
    s.send_multipart(m)
"""

_STORER = """
import sys, numpy as np, torch
from dataplane.client import WorkerAdapter, allocate_kv_caches
torch.set_num_threads(1)
caches = allocate_kv_caches(8, 64, 16, 8, 128, torch.bfloat16)
w = WorkerAdapter(sys.argv[1], "bench-ping", heartbeat_interval=5.0, request_timeout=60)
w.register_kv_caches(caches)
rng = np.random.default_rng()
print("ready", flush=True)
while True:
    w.store(rng.integers(0, 1 << 30, 1024), rng.permutation(64))
"""


def add_args(sub: Any) -> None:
    p = sub.add_parser("ping", help="PING p50/p99 vs raw ZMQ, idle and under STORE load")
    p.add_argument("--pings", type=int, default=None, help="samples of each figure (4,000; quick 1,000)")
    p.add_argument("--storers", type=int, default=None, help="worker processes storing back to back (4)")
    add_output_args(p)
    p.set_defaults(func=run_ping)


def _round_trips(sock: zmq.Socket[Any], frame: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(frame)
        sock.recv()
        out.append(time.perf_counter() - t0)
    return out


def run_ping(ns: argparse.Namespace) -> int:
    resolve(ns, pings=(4000, 1000, 200), storers=(4, 4, 1))
    if ns.pings < 100 or ns.storers < 0:
        print("bench: --pings must be at least 100 and --storers not negative", file=sys.stderr)
        return 2
    server = launch("--l1-size-gb", "1")
    echo = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    storers: list[subprocess.Popen[str]] = []
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        assert echo.stdout is not None
        echo_port = int(echo.stdout.readline())
        wait_http(server)
        wait_arena_ready(server)  # its fault-in thread is done: idle is idle
        raw = ctx.socket(zmq.DEALER)
        raw.connect(f"tcp://127.0.0.1:{echo_port}")
        srv = ctx.socket(zmq.DEALER)
        srv.connect(server.endpoint)
        frame = encode_message(1, Ping(12345, bytes(16)))  # an unknown id: a PING as a worker sends it
        raw_s, ping_s = _interleaved(raw, srv, frame, ns.pings)
        storers = [
            subprocess.Popen(
                [sys.executable, "-c", _STORER, server.endpoint], stdout=subprocess.PIPE, text=True
            )
            for _ in range(ns.storers)
        ]
        for p in storers:
            assert p.stdout is not None
            p.stdout.readline()
        loaded = _round_trips(srv, frame, ns.pings)
        raw.send(b"quit")
    finally:
        for p in storers:
            p.kill()
            p.wait()
        echo.kill()
        echo.wait()
        ctx.destroy(linger=0)
        server.stop()
    # after the processes above were waited for: their CPU time is ours, not noise
    finish(ns, "ping", _report(ns, raw_s, ping_s, loaded), report.show("ping"))
    return 0


def _interleaved(
    raw: zmq.Socket[Any], srv: zmq.Socket[Any], frame: bytes, n: int
) -> tuple[list[float], list[float]]:
    """Round trips to the raw echo and to the server, alternating in blocks (after a warm-up),
    so machine noise hits both alike."""
    _round_trips(raw, frame, 300)
    _round_trips(srv, frame, 300)
    raw_s: list[float] = []
    ping_s: list[float] = []
    step = max(100, n // 10)
    for _ in range(max(1, n // step)):
        raw_s += _round_trips(raw, frame, step)
        ping_s += _round_trips(srv, frame, step)
    return raw_s, ping_s


def _report(
    ns: argparse.Namespace, raw_s: list[float], ping_s: list[float], loaded: list[float]
) -> dict[str, Any]:
    raw, idle = latency(raw_s), latency(ping_s)
    return {
        "params": {"pings": ns.pings, "storers": ns.storers},
        "raw_zmq": raw,
        "ping_idle": idle,
        "ping_loaded": latency(loaded),
        "ratios": {
            "ping_idle_p99_vs_raw_p99": idle["p99_us"] / raw["p99_us"],
            "ping_idle_p50_vs_raw_p50": idle["p50_us"] / raw["p50_us"],
        },
    }
