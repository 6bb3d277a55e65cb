"""`kvwarden bench http`: the HTTP sidecar with many tracked instances, and PING meanwhile.

A server process is started with its instance limits raised; many instances are registered
cheaply (`kvbench.bulk`). Then, in order:

- **load** (``--load-instances``, 1,000): PING round trips, paced (one every
  ``--ping-interval-ms``), in three blocks: idle, while another process GETs `/status`
  ``--rate`` times a second, idle again. The figure is the loaded p99 over the worse idle p99.
- **large** (``--instances``, 10,000): PING idle, then PING while another process GETs
  `/status` and `/metrics` alternately back to back (their latencies are the HTTP figures),
  then idle again. ``--instances 0`` skips it. Last, the yardstick: PING while two processes
  spin and send nothing (the closed loop keeps two cores busy, the client and the sidecar), so
  the report shows how much of the loaded p99 the scheduler alone costs on this machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

from kvbench import report
from kvbench.bulk import BulkRegistrar
from kvbench.procs import BenchServer, launch, wait_arena_ready, wait_http
from kvbench.results import add_output_args, finish, latency, resolve


def add_args(sub: Any) -> None:
    p = sub.add_parser("http", help="/status and /metrics with 10,000 instances; PING under /status load")
    p.add_argument(
        "--instances",
        type=int,
        default=None,
        help="tracked in the large phase (10,000; quick 5,000; 0 skips)",
    )
    p.add_argument("--load-instances", type=int, default=None, help="tracked in the load phase (1,000)")
    p.add_argument("--rate", type=float, default=50.0, help="/status requests per second in the load phase")
    p.add_argument("--pings", type=int, default=None, help="PINGs per block (3,000; quick 600)")
    p.add_argument("--ping-interval-ms", type=float, default=2.0)
    add_output_args(p)
    p.set_defaults(func=run_http)


def run_http(ns: argparse.Namespace) -> int:
    resolve(ns, instances=(10_000, 5_000, 300), load_instances=(1000, 1000, 100), pings=(3000, 600, 150))
    if ns.load_instances < 1 or ns.instances < 0 or ns.pings < 10 or ns.rate <= 0:
        print("bench: --load-instances >= 1, --instances >= 0, --pings >= 10, --rate > 0", file=sys.stderr)
        return 2
    limit = str(max(ns.instances, ns.load_instances) + 64)
    flags = ["--max-instances", limit, "--max-instances-per-connection", limit, "--l1-size-gb", "0.25"]
    server = launch(*flags, "--log-level", "error")  # not the warning that 2 descriptors each may run short
    out: dict[str, Any] = {"params": {k: getattr(ns, k) for k in ("rate", "pings", "ping_interval_ms")}}
    try:
        wait_http(server)
        wait_arena_ready(server)  # the fault-in thread is done: idle is idle
        reg = BulkRegistrar(server.endpoint)
        try:
            out["load"] = _load_phase(ns, server, reg)
            if ns.instances:
                out["large"] = _large_phase(ns, server, reg)
        finally:
            reg.close()
    finally:
        server.stop()
    finish(ns, "http", out, report.show("http"))
    return 0


class _Pinger:
    """Paced PINGs of the template instance on a raw DEALER socket of its own."""

    def __init__(self, endpoint: str, frame: bytes, interval_s: float) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.frame, self.interval = frame, interval_s
        self.pause = threading.Event()

    def block(self, n: int) -> list[float]:
        out = []
        due = time.perf_counter()
        for _ in range(n):
            due += self.interval
            t0 = time.perf_counter()
            self.sock.send(self.frame)
            if not self.sock.poll(30_000):
                raise RuntimeError("PING: no reply in 30 s")
            self.sock.recv()
            out.append(time.perf_counter() - t0)
            delay = due - time.perf_counter()
            if delay > 0:
                self.pause.wait(delay)  # pacing
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _loader(url: str, *mode: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "kvbench.loadgen", url, *mode]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    if p.stdout.readline().strip() != "ready":
        p.kill()
        raise RuntimeError("the HTTP load generator did not start")
    return p


def _loaded(pinger: _Pinger, n: int, loader: subprocess.Popen[str]) -> tuple[list[float], dict[str, Any]]:
    """``n`` PINGs while ``loader`` runs; then the loader's report."""
    try:
        pings = pinger.block(n)
    finally:
        out, _ = loader.communicate(timeout=120)  # closes its stdin: it stops and reports
    return pings, json.loads(out.splitlines()[-1])


def _spun(pinger: _Pinger, n: int, url: str, spinners: int) -> list[float]:
    """``n`` PINGs while ``spinners`` processes keep a core busy each (no request sent)."""
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(spinners):
            procs.append(_loader(url, "spin"))
        return pinger.block(n)
    finally:
        for p in procs:
            p.communicate(timeout=120)


def _ms(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs or [float("nan")]) * 1e3
    return {"n": len(xs), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def _tracked(server: BenchServer) -> int:
    return int(server.json("/status")["worker_liveness"]["tracked_instances"])


def _load_phase(ns: argparse.Namespace, server: BenchServer, reg: BulkRegistrar) -> dict[str, Any]:
    reg.grow_to(ns.load_instances)
    pinger = _Pinger(server.endpoint, reg.ping_frame(), ns.ping_interval_ms / 1e3)
    try:
        pinger.block(200)  # warm-up
        idle = pinger.block(ns.pings)
        loaded, load = _loaded(pinger, ns.pings, _loader(server.url, "paced", str(ns.rate)))
        idle2 = pinger.block(ns.pings)
    finally:
        pinger.close()
    worse_idle = max(latency(idle)["p99_us"], latency(idle2)["p99_us"])
    return {
        "instances": _tracked(server),
        "rate": ns.rate,
        "ping_idle": latency(idle),
        "ping_with_status": latency(loaded),
        "ping_idle_again": latency(idle2),
        "ratio_p99": latency(loaded)["p99_us"] / worse_idle,
        "status_ms": {
            **_ms(load["latency_s"]["/status"]),
            "errors": load["errors"],
            "issued": load["issued"],
        },
    }


def _large_phase(ns: argparse.Namespace, server: BenchServer, reg: BulkRegistrar) -> dict[str, Any]:
    t0 = time.perf_counter()
    reg.grow_to(ns.instances)
    took = time.perf_counter() - t0
    pinger = _Pinger(server.endpoint, reg.ping_frame(), ns.ping_interval_ms / 1e3)
    try:
        pinger.block(200)
        idle = pinger.block(ns.pings)
        loaded, load = _loaded(pinger, ns.pings, _loader(server.url, "closed"))
        idle2 = pinger.block(ns.pings)
        spun = _spun(pinger, ns.pings, server.url, 2)
    finally:
        pinger.close()
    worse_idle = max(latency(idle)["p99_us"], latency(idle2)["p99_us"])
    return {
        "instances": _tracked(server),
        "register_s": took,
        "ping_during_spin": latency(spun),
        "ratio_p99_spin": latency(spun)["p99_us"] / worse_idle,
        "status_ms": _ms(load["latency_s"]["/status"]),
        "metrics_ms": _ms(load["latency_s"]["/metrics"]),
        "http_errors": load["errors"],
        "ping_idle": latency(idle),
        "ping_during_http": latency(loaded),
        "ping_idle_again": latency(idle2),
        "ratio_p99": latency(loaded)["p99_us"] / worse_idle,
    }
