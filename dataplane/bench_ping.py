"""`kvwarden bench ping`: PING round trips through the server beside a raw ZMQ echo.

Both peers are separate processes, so the ratio isolates what the server adds (decode,
validate, touch, encode) to a bare DEALER -> ROUTER round trip. Samples alternate in rounds
so machine noise hits both alike. Then the same PING is measured while worker processes STORE
back to back (the transfer pool busy, the GIL contended).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np
import zmq

from dataplane.protocol import encode_request

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


def add_ping_args(sub: Any) -> None:
    p = sub.add_parser("ping", help="PING p50/p99 vs raw ZMQ, idle and under STORE load")
    p.add_argument("--pings", type=int, default=4000, help="samples of each figure")
    p.add_argument("--storers", type=int, default=4, help="worker processes storing back to back")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_ping)


def _round_trips(sock: zmq.Socket[Any], frame: bytes, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        sock.send(frame)
        sock.recv()
        out.append(time.perf_counter() - t0)
    return out


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99))}


def run_ping(ns: argparse.Namespace) -> int:
    from dataplane.bench import _wait_ready, free_port, stop_process
    from dataplane.client import WorkerAdapter

    port, http_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "dataplane.cli", "serve", "--port", str(port),
                               "--http-port", str(http_port), "--log-level", "warning"])
    echo = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE, text=True)
    storers: list[subprocess.Popen[str]] = []
    ctx: zmq.Context[Any] = zmq.Context()
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        assert echo.stdout is not None
        echo_port = int(echo.stdout.readline())
        _wait_ready(lambda: WorkerAdapter(endpoint, "b", request_timeout=0.5).close(), server, 60)
        raw = ctx.socket(zmq.DEALER)
        raw.connect(f"tcp://127.0.0.1:{echo_port}")
        srv = ctx.socket(zmq.DEALER)
        srv.connect(endpoint)
        frame = encode_request(1, "PING", [12345])
        _round_trips(raw, frame, 300)
        _round_trips(srv, frame, 300)
        raw_s: list[float] = []
        ping_s: list[float] = []
        step = max(100, ns.pings // 10)
        for _ in range(max(1, ns.pings // step)):
            raw_s += _round_trips(raw, frame, step)
            ping_s += _round_trips(srv, frame, step)
        for _ in range(ns.storers):
            p = subprocess.Popen([sys.executable, "-c", _STORER, endpoint], stdout=subprocess.PIPE,
                                 text=True)
            storers.append(p)
        for p in storers:
            assert p.stdout is not None
            p.stdout.readline()
        loaded = _round_trips(srv, frame, ns.pings)
        raw.send(b"quit")
        report = {"raw_zmq": _pct(raw_s), "ping_idle": _pct(ping_s),
                  f"ping_with_{ns.storers}_storers": _pct(loaded)}
        report["ratios"] = {
            "ping_idle_p99_vs_raw_p99": report["ping_idle"]["p99_us"] / report["raw_zmq"]["p99_us"],
            "ping_idle_p50_vs_raw_p50": report["ping_idle"]["p50_us"] / report["raw_zmq"]["p50_us"],
        }
        if ns.json:
            print(json.dumps(report, indent=2))
        else:
            for k, v in report.items():
                print(f"  {k:<24} " + "  ".join(f"{a}={b:.1f}" if "us" in a else f"{a}={b:.2f}x"
                                                 for a, b in v.items()))
        return 0
    finally:
        for p in storers:
            p.kill()
            p.wait()
        echo.kill()
        echo.wait()
        ctx.destroy(linger=0)
        stop_process(server)
