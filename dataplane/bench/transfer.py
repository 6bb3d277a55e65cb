"""`kvwarden bench transfer`: full-stack STORE / RETRIEVE throughput beside same-run baselines.

A server process is started on free ports; this process is the worker. Each round takes one
sample of every figure in turn (memcpy, STORE, RETRIEVE, raw ZMQ, Redis SET/GET), so machine
noise hits them alike; the report gives medians and their ratios.

Unit of work: a chunk of 256 tokens of a Llama-3-8B-shaped KV cache (32 layers x K,V x 8 heads
x 128 head dim x bf16 = 32 MiB). Blocks are assigned at random, as a paged allocator would.
The figures are steady state: L1 is filled once before the rounds, so its buffers recycle.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from dataplane.bench.procs import free_port, start_server, stop_process, wait_server
from dataplane.wire.messages import SUPPORTED_DTYPES

Figure = Callable[[], float]  # one sample, in bytes per second


def add_args(sub: Any) -> None:
    t = sub.add_parser("transfer", help="STORE/RETRIEVE GB/s vs memcpy, raw ZMQ and Redis")
    t.add_argument("--rounds", type=int, default=15, help="samples of each figure")
    t.add_argument(
        "--chunks-per-request",
        default="1,4",
        help="comma-separated: one report per value (1 = a 256-token request, 4 = a 1K-token prompt)",
    )
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


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return float(time.perf_counter() - t0)


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
    proc = subprocess.Popen(
        [
            exe,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--proto-max-bulk-len",
            "1gb",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=30)
    deadline = time.monotonic() + 10
    pause = threading.Event()
    while time.monotonic() < deadline:
        try:
            r.ping()
            return proc, r
        except redis.ConnectionError:
            pause.wait(0.02)
    proc.kill()
    proc.wait()
    return None


def run_transfer(ns: argparse.Namespace) -> int:
    try:
        values = [int(v) for v in str(ns.chunks_per_request).split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        print("bench: --chunks-per-request takes positive integers, e.g. 1,4", file=sys.stderr)
        return 2
    if ns.chunk_size % ns.block_size:
        print("bench: --chunk-size must be a multiple of --block-size", file=sys.stderr)
        return 2
    reports = [_run_once(ns, cpr) for cpr in values]
    if ns.json:
        print(json.dumps(reports if len(reports) > 1 else reports[0], indent=2))
    else:
        for report in reports:
            _print(report)
    return 0


@dataclass
class _Shape:
    """What one run moves: chunk bytes, tokens and blocks of one request."""

    chunk_bytes: int
    chunks_per_request: int
    tokens: int
    blocks: int  # blocks one request's tokens fill

    @classmethod
    def of(cls, ns: argparse.Namespace, cpr: int) -> _Shape:
        import torch

        from dataplane.memory.kvmemory import TORCH_DTYPES

        item = torch.empty((), dtype=TORCH_DTYPES[ns.dtype]).element_size()
        chunk_bytes = ns.layers * 2 * ns.chunk_size * ns.heads * ns.head_dim * item
        return cls(chunk_bytes, cpr, cpr * ns.chunk_size, cpr * ns.chunk_size // ns.block_size)


def _run_once(ns: argparse.Namespace, cpr: int) -> dict[str, Any]:
    shape = _Shape.of(ns, cpr)
    l1_chunks = max(4 * cpr, 8)
    env = {k: v for k, v in os.environ.items() if k != "KVWARDEN_ADMIN_TOKEN"}
    l1_gb = l1_chunks * shape.chunk_bytes / (1 << 30)
    proc, endpoint = start_server("--chunk-size", str(ns.chunk_size), "--l1-size-gb", str(l1_gb), env=env)
    zctx: zmq.Context[Any] = zmq.Context()
    redis_pair = None if ns.no_redis else _start_redis()
    w = None
    try:
        wait_server(proc, endpoint)
        w = _registered_worker(ns, endpoint, shape)
        fixed = np.random.default_rng(1).integers(0, 1 << 30, shape.tokens)
        fns, done = _figures(w, shape, fixed, zctx, redis_pair)
        # warm-up: fill L1 so its buffers recycle (steady state), fault everything in once
        for _ in range(max(2, l1_chunks // cpr)):
            for name, fn in fns.items():
                if name != "retrieve":
                    fn()
            _keep_resident(w, fixed, shape)
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(ns.rounds):
            _keep_resident(w, fixed, shape)  # the retrieved prefix stays in L1
            for name, fn in fns.items():
                samples[name].append(fn())
        done()
        return _report(shape, ns.rounds, samples)
    finally:
        if w is not None:
            w.close()
        zctx.destroy(linger=0)
        if redis_pair is not None:
            redis_pair[0].kill()
            redis_pair[0].wait()
        stop_process(proc)


def _registered_worker(ns: argparse.Namespace, endpoint: str, shape: _Shape) -> Any:
    import torch

    from dataplane.client import WorkerAdapter, allocate_kv_caches
    from dataplane.memory.kvmemory import TORCH_DTYPES

    num_blocks = 2 * shape.blocks  # one half stores, the other receives
    caches = allocate_kv_caches(
        ns.layers, num_blocks, ns.block_size, ns.heads, ns.head_dim, TORCH_DTYPES[ns.dtype], ns.device
    )
    for c in caches:
        c.view(torch.uint8).random_()
    w = WorkerAdapter(endpoint, "bench", heartbeat_interval=5.0, request_timeout=120)
    w.register_kv_caches(caches)
    return w


def _keep_resident(w: Any, fixed: np.ndarray, shape: _Shape) -> None:
    if not w.store(fixed, np.arange(shape.blocks)):
        raise RuntimeError("STORE of the retrieved prefix was rejected")


def _figures(
    w: Any, shape: _Shape, fixed: np.ndarray, zctx: zmq.Context[Any], redis_pair: tuple[Any, Any] | None
) -> tuple[dict[str, Figure], Callable[[], None]]:
    """Every figure's sampler, and what ends the raw ZMQ baseline's sink."""
    import torch

    rng = np.random.default_rng(0)
    n, payload = shape.chunk_bytes, shape.chunks_per_request * shape.chunk_bytes
    src = torch.empty(n, dtype=torch.uint8).random_()
    dst = torch.zeros(n, dtype=torch.uint8)
    blob = src.numpy().tobytes()
    sink = _ZmqSink(zctx)
    dealer = zctx.socket(zmq.DEALER)
    dealer.connect(sink.endpoint)

    def done() -> None:
        dealer.send(b"")  # the sink answers and its thread ends
        dealer.recv()
        sink.thread.join(5)
        dealer.close(linger=0)

    def memcpy() -> float:
        prev = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return n / _timed(lambda: dst.copy_(src))
        finally:
            torch.set_num_threads(prev)

    def store() -> float:
        toks, blocks = rng.integers(0, 1 << 30, shape.tokens), rng.permutation(shape.blocks)
        t0 = time.perf_counter()
        if not w.store(toks, blocks):
            raise RuntimeError("STORE rejected")
        return payload / (time.perf_counter() - t0)

    def retrieve() -> float:
        blocks = shape.blocks + rng.permutation(shape.blocks)
        t0 = time.perf_counter()
        got = w.retrieve(fixed, blocks)
        took = time.perf_counter() - t0
        if got != shape.tokens:
            raise RuntimeError(f"RETRIEVE got {got} of {shape.tokens} tokens")
        return payload / took

    def zmq_send() -> float:
        return n / _timed(lambda: (dealer.send(blob, copy=False), dealer.recv()))

    fns: dict[str, Figure] = {"memcpy": memcpy, "store": store, "retrieve": retrieve, "zmq": zmq_send}
    if redis_pair is not None:
        r = redis_pair[1]
        fns["redis_set"] = lambda: n / _timed(lambda: r.set("bench", blob))
        fns["redis_get"] = lambda: n / _timed(lambda: r.get("bench"))
    return fns, done


def _report(shape: _Shape, rounds: int, samples: dict[str, list[float]]) -> dict[str, Any]:
    med = {k: statistics.median(v) / 1e9 for k, v in samples.items()}
    ratios = {
        "store_vs_memcpy": med["store"] / med["memcpy"],
        "retrieve_vs_memcpy": med["retrieve"] / med["memcpy"],
        "store_vs_zmq": med["store"] / med["zmq"],
        "retrieve_vs_zmq": med["retrieve"] / med["zmq"],
    }
    if "redis_set" in med:
        ratios["store_vs_redis_set"] = med["store"] / med["redis_set"]
        ratios["retrieve_vs_redis_get"] = med["retrieve"] / med["redis_get"]
    return {
        "chunk_bytes": shape.chunk_bytes,
        "chunks_per_request": shape.chunks_per_request,
        "rounds": rounds,
        "gbps": med,
        "ratios": ratios,
    }


def _print(report: dict[str, Any]) -> None:
    mib = report["chunk_bytes"] / (1 << 20)
    print(
        f"kvwarden bench transfer: {mib:.0f} MiB chunks, {report['chunks_per_request']} per "
        f"request, median of {report['rounds']} rounds (steady state: L1 warmed first)"
    )
    for name, v in report["gbps"].items():
        print(f"  {name:<10} {v:8.2f} GB/s")
    for name, v in report["ratios"].items():
        print(f"  {name:<24} {v:6.2f}x")
