#!/usr/bin/env python3
"""PING round trip through a real `kvwarden serve`, idle and under `/status` load.

Starts the server as a subprocess (its own process and GIL, as in production), registers
``--instances`` tracked instances (one worker's tiny shared-memory cache under many ids, sent as
raw REGISTER frames), then measures PING round trips (paced, one every ``--ping-interval-ms``)
in three blocks: idle, while another process issues ``GET /status`` at ``--rate`` requests per
second from a thread pool, and idle again. Prints p50/p99 of each block and the ratio of the
loaded p99 to the idle one (the target is <= 1.5x; docs: performance targets).

    .venv/bin/python scripts/ping_under_status_load.py [--instances 1000] [--pings 2000]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dataplane.bench.procs import free_port  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ---------------------------------------------------------------------------- status load


def status_load(url: str, rate: float, stop: Any, results: Any) -> None:
    """Issue GET /status at ``rate`` per second from a thread pool until ``stop`` is set."""
    latencies: list[float] = []
    errors = 0

    def one() -> None:
        nonlocal errors
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(url + "/status", timeout=10) as r:
                r.read()
            latencies.append(time.perf_counter() - t0)
        except OSError:
            errors += 1

    pool = ThreadPoolExecutor(8)
    start = time.perf_counter()
    for i in itertools.count():
        if stop.is_set():
            break
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        pool.submit(one)
    pool.shutdown(wait=True, cancel_futures=True)  # a server that fell behind: drop the backlog
    results.put((latencies, errors, i))


# ---------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=50.0, help="/status requests per second")
    ap.add_argument("--ping-interval-ms", type=float, default=2.0)
    ns = ap.parse_args()

    import torch
    import zmq

    from dataplane.client import WorkerAdapter, allocate_kv_caches
    from dataplane.wire.messages import MsgType
    from dataplane.wire.protocol import decode_reply, encode_message, encode_request

    port, http_port = free_port(), free_port()
    endpoint, url = f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    fd, log_name = tempfile.mkstemp(prefix="kvwarden-ping-", suffix=".log")
    env = dict(os.environ, PYTHONPATH=str(ROOT), KVWARDEN_LOG_LEVEL="warning")
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--http-port", str(http_port)]
    with os.fdopen(fd, "wb") as log:
        server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    rids = itertools.count(1)

    def call(mtype: MsgType, payload: list[Any], timeout_s: float = 30.0) -> Any:
        rid = next(rids)
        sock.send(encode_request(rid, mtype, payload))
        if not sock.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"{mtype}: no reply in {timeout_s:g}s (log: {log_name})")
        reply = decode_reply(sock.recv())
        assert reply.ok and reply.request_id == rid, reply
        return reply.body

    worker: WorkerAdapter | None = None
    try:
        deadline = time.monotonic() + 60
        while True:  # the sidecar answers last
            try:
                with urllib.request.urlopen(url + "/livez", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start (log: {log_name})") from None
                time.sleep(0.05)
        worker = WorkerAdapter(endpoint, model_name="m", heartbeat_interval=10.0)
        worker.register_kv_caches(allocate_kv_caches(2, 8, 16, 2, 8, torch.bfloat16))
        reg = worker.registration
        assert reg is not None
        t0 = time.perf_counter()
        window = 256
        ids = [uuid.uuid4().int & ((1 << 63) - 1) for _ in range(ns.instances - 1)]
        for i in range(0, len(ids), window):
            batch = ids[i : i + window]
            for iid in batch:
                sock.send(encode_message(next(rids), dataclasses.replace(reg, instance_id=iid)))
            for _ in batch:
                if not sock.poll(60_000):
                    raise RuntimeError("REGISTER replies stopped")
                assert decode_reply(sock.recv()).ok
        with urllib.request.urlopen(url + "/status", timeout=30) as r:
            tracked = json.loads(r.read())["worker_liveness"]["tracked_instances"]
        print(f"registered {tracked} tracked instances in {time.perf_counter() - t0:.1f}s")

        def ping_block(n: int) -> list[float]:
            out = []
            interval = ns.ping_interval_ms / 1000
            next_at = time.perf_counter()
            for _ in range(n):
                next_at += interval
                t = time.perf_counter()
                call(MsgType.PING, [worker.instance_id if worker else None])
                out.append(time.perf_counter() - t)
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            return out

        ping_block(200)  # warm-up
        idle = ping_block(ns.pings)
        mpctx = mp.get_context("spawn")
        stop, results = mpctx.Event(), mpctx.Queue()
        loader = mpctx.Process(target=status_load, args=(url, ns.rate, stop, results))
        loader.start()
        time.sleep(1.0)  # let the load reach its pace
        loaded = ping_block(ns.pings)
        stop.set()
        status_lat, errors, issued = results.get(timeout=120)
        loader.join(30)
        idle2 = ping_block(ns.pings)
    finally:
        if worker is not None:
            worker.close()
        sock.close(linger=0)
        ctx.term()
        server.terminate()
        server.wait(30)

    def line(name: str, xs: list[float]) -> str:
        return (
            f"{name:<28} n={len(xs):5d}  p50 {statistics.median(xs) * 1e6:8.0f} us  "
            f"p99 {pct(xs, 0.99) * 1e6:8.0f} us"
        )

    print(f"PING round trip, {tracked} tracked instances, one PING every {ns.ping_interval_ms:g} ms:")
    print(line("idle", idle))
    print(line(f"/status at {ns.rate:g}/s", loaded))
    print(line("idle again", idle2))
    base = max(pct(idle, 0.99), pct(idle2, 0.99))
    print(f"loaded p99 / idle p99 (worse idle block): {pct(loaded, 0.99) / base:.2f}x")
    if status_lat:
        print(
            f"/status during the load: {issued} issued, {len(status_lat)} answered, "
            f"{errors} errors, "
            f"p50 {statistics.median(status_lat) * 1e3:.1f} ms, "
            f"p99 {pct(status_lat, 0.99) * 1e3:.1f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
