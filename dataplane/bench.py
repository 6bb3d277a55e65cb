"""`kvwarden bench transfer`: full-stack STORE / RETRIEVE throughput beside same-run baselines.

A server process is started on free ports; this process is the worker. Each round takes one
sample of every figure in turn (memcpy, STORE, RETRIEVE, raw ZMQ, Redis SET/GET), so machine
noise hits them alike; the report gives medians and their ratios.

Unit of work: a chunk of 256 tokens of a Llama-3-8B-shaped KV cache (32 layers x K,V x 8 heads
x 128 head dim x bf16 = 32 MiB). Blocks are assigned at random, as a paged allocator would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from dataplane.protocol import SUPPORTED_DTYPES


def add_bench_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    t = sub.add_parser("transfer", help="STORE/RETRIEVE GB/s vs memcpy, raw ZMQ and Redis")
    t.add_argument("--rounds", type=int, default=15, help="samples of each figure")
    t.add_argument("--chunks-per-request", default="1,4",
                   help="comma-separated: one report per value (1 = a 256-token request, "
                        "4 = a 1K-token prompt)")
    t.add_argument("--layers", type=int, default=32)
    t.add_argument("--heads", type=int, default=8)
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument("--chunk-size", type=int, default=256)
    t.add_argument("--dtype", default="bfloat16", choices=sorted(SUPPORTED_DTYPES))
    t.add_argument("--device", default="cpu", help="cpu or cuda (worker KV memory)")
    t.add_argument("--no-redis", action="store_true", help="skip the Redis baselines")
    t.add_argument("--json", action="store_true", help="print the figures as JSON")
    t.set_defaults(func=run_transfer)
    from dataplane.bench_ping import add_ping_args

    add_ping_args(sub)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 15.0) -> None:
    """SIGTERM (the server drains and exits), SIGKILL if it has not within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return float(time.perf_counter() - t0)


def _wait_ready(adapter_factory: Callable[[], Any], proc: subprocess.Popen[bytes],
                timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            adapter_factory()
            return
        except Exception:
            continue
    raise RuntimeError("server did not answer in time")


class _ZmqSink:
    """A ROUTER thread that acknowledges every frame: the naive data plane."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-zmq-sink")
        self.thread.start()

    def _run(self) -> None:
        while True:
            ident, data = self.sock.recv_multipart(copy=False)
            if len(data) == 0:
                self.sock.send_multipart([ident, b"bye"])
                return
            self.sock.send_multipart([ident, b"ok"])


def _start_redis() -> tuple[subprocess.Popen[bytes], Any] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    import redis

    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--proto-max-bulk-len", "1gb"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            r.ping()
            return proc, r
        except redis.ConnectionError:
            continue
    proc.kill()
    return None


def run_transfer(ns: argparse.Namespace) -> int:
    try:
        values = [int(v) for v in str(ns.chunks_per_request).split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        print("bench: --chunks-per-request takes positive integers, e.g. 1,4", file=sys.stderr)
        return 2
    reports = []
    for cpr in values:
        rc, report = _run_transfer_once(ns, cpr)
        if rc:
            return rc
        reports.append(report)
    if ns.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    else:
        for report in reports:
            _print(report)
    return 0


def _run_transfer_once(ns: argparse.Namespace, cpr: int) -> tuple[int, dict[str, Any]]:
    import torch

    from dataplane.client import WorkerAdapter, allocate_kv_caches
    from dataplane.kvmemory import TORCH_DTYPES

    dtype = TORCH_DTYPES[ns.dtype]
    cs, bs = ns.chunk_size, ns.block_size
    if cs % bs:
        print("bench: --chunk-size must be a multiple of --block-size", file=sys.stderr)
        return 2, {}
    item = torch.empty((), dtype=dtype).element_size()
    chunk_bytes = ns.layers * 2 * cs * ns.heads * ns.head_dim * item
    blocks_per_req = cpr * cs // bs
    num_blocks = 2 * blocks_per_req
    l1_chunks = max(4 * cpr, 8)
    port, http_port = free_port(), free_port()
    env = {**os.environ, "KVWARDEN_ADMIN_TOKEN": ""}
    env.pop("KVWARDEN_ADMIN_TOKEN")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataplane.cli", "serve", "--port", str(port),
         "--http-port", str(http_port), "--chunk-size", str(cs),
         "--l1-size-gb", str(l1_chunks * chunk_bytes / (1 << 30)), "--log-level", "warning"],
        env=env,
    )
    endpoint = f"tcp://127.0.0.1:{port}"
    zctx: zmq.Context[Any] = zmq.Context()
    redis_pair = None if ns.no_redis else _start_redis()
    w = None
    try:
        _wait_ready(lambda: WorkerAdapter(endpoint, "bench", request_timeout=0.5).close(), proc, 60)
        caches = allocate_kv_caches(ns.layers, num_blocks, bs, ns.heads, ns.head_dim, dtype,
                                    ns.device)
        for c in caches:
            c.view(torch.uint8).random_()
        w = WorkerAdapter(endpoint, "bench", heartbeat_interval=5.0, request_timeout=120)
        w.register_kv_caches(caches)
        rng = np.random.default_rng(0)
        n_tok = cpr * cs
        payload = cpr * chunk_bytes
        src = torch.empty(chunk_bytes, dtype=torch.uint8).random_()
        dst = torch.empty(chunk_bytes, dtype=torch.uint8).fill_(0)
        sink = _ZmqSink(zctx)
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(sink.endpoint)
        blob = src.numpy().tobytes()
        fixed = rng.integers(0, 1 << 30, n_tok)

        def memcpy() -> float:
            prev = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return float(chunk_bytes / _timed(lambda: dst.copy_(src)))
            finally:
                torch.set_num_threads(prev)

        def store() -> float:
            toks = rng.integers(0, 1 << 30, n_tok)
            blocks = rng.permutation(blocks_per_req)
            ok = False

            def once() -> None:
                nonlocal ok
                ok = w.store(toks, blocks)

            t = _timed(once)
            if not ok:
                raise RuntimeError("STORE rejected")
            return float(payload / t)

        def retrieve() -> float:
            blocks = blocks_per_req + rng.permutation(blocks_per_req)
            got = 0

            def once() -> None:
                nonlocal got
                got = w.retrieve(fixed, blocks)

            t = _timed(once)
            if got != n_tok:
                raise RuntimeError(f"RETRIEVE got {got} of {n_tok} tokens")
            return float(payload / t)

        def zmq_send() -> float:
            def once() -> None:
                dealer.send(blob, copy=False)
                dealer.recv()

            return float(chunk_bytes / _timed(once))

        figures: dict[str, list[float]] = {"memcpy": [], "store": [], "retrieve": [], "zmq": []}
        fns: dict[str, Callable[[], float]] = {"memcpy": memcpy, "store": store,
                                                "retrieve": retrieve, "zmq": zmq_send}
        if redis_pair is not None:
            r = redis_pair[1]
            figures["redis_set"], figures["redis_get"] = [], []
            fns["redis_set"] = lambda: chunk_bytes / _timed(lambda: r.set("bench", blob))
            fns["redis_get"] = lambda: chunk_bytes / _timed(lambda: r.get("bench"))
        # warm-up: fill L1 so its buffers recycle (steady state), fault everything in once
        if not w.store(fixed, np.arange(blocks_per_req)):
            raise RuntimeError("warm-up STORE rejected")
        for _ in range(max(2, l1_chunks // cpr)):
            for name, fn in fns.items():
                if name != "retrieve":
                    fn()
            w.store(fixed, np.arange(blocks_per_req))
        for _ in range(ns.rounds):
            w.store(fixed, np.arange(blocks_per_req))  # keep the retrieved prefix resident
            for name, fn in fns.items():
                figures[name].append(fn())
        dealer.send(b"")
        dealer.recv()
        dealer.close(linger=0)
        med = {k: statistics.median(v) / 1e9 for k, v in figures.items()}
        report = {
            "chunk_bytes": chunk_bytes, "chunks_per_request": cpr, "rounds": ns.rounds,
            "gbps": med,
            "ratios": {
                "store_vs_memcpy": med["store"] / med["memcpy"],
                "retrieve_vs_memcpy": med["retrieve"] / med["memcpy"],
                "store_vs_zmq": med["store"] / med["zmq"],
                "retrieve_vs_zmq": med["retrieve"] / med["zmq"],
            },
        }
        if "redis_set" in med:
            report["ratios"]["store_vs_redis_set"] = med["store"] / med["redis_set"]
            report["ratios"]["retrieve_vs_redis_get"] = med["retrieve"] / med["redis_get"]
        return 0, report
    finally:
        if w is not None:
            w.close()
        zctx.destroy(linger=0)
        if redis_pair is not None:
            redis_pair[0].kill()
            redis_pair[0].wait()
        stop_process(proc)


def _print(report: dict[str, Any]) -> None:
    mib = report["chunk_bytes"] / (1 << 20)
    print(f"kvwarden bench transfer: {mib:.0f} MiB chunks, {report['chunks_per_request']} per "
          f"request, median of {report['rounds']} rounds")
    for name, v in report["gbps"].items():
        print(f"  {name:<10} {v:8.2f} GB/s")
    for name, v in report["ratios"].items():
        print(f"  {name:<24} {v:6.2f}x")
