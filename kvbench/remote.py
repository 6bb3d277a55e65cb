"""`kvwarden bench remote`: the Redis tier, beside the same bytes through redis-py.

A throwaway ``redis-server`` (no persistence) and three fresh servers (no warm-up): A without a
remote tier, B and C with it, one server-driven worker each (Llama-3-8B's KV shape, 32 MiB
chunks of 256 tokens). In the same run, interleaved:

- **STORE** of a distinct one-chunk prompt through A, then through B (Redis configured: the chunk
  is queued for Redis behind the reply): the latency ratio B / A. Uploads of earlier chunks may
  still be running meanwhile, as they would in service.
- **Remote RETRIEVE** of each prompt B stored, through C (its L1 cold: Redis -> C's L1 -> the
  worker), then a raw redis-py GET of a stored value of the same size: the time ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from kvbench import report
from kvbench.movers import start_redis
from kvbench.procs import BenchServer, drained, launch, wait_arena_ready, wait_http
from kvbench.results import add_output_args, finish, resolve

BS, CS = 16, 256


def add_args(sub: Any) -> None:
    p = sub.add_parser(
        "remote", help="the Redis tier: remote RETRIEVE vs redis-py GET, STORE with vs without Redis"
    )
    p.add_argument("--samples", type=int, default=None, help="prompts per figure (9; quick 5)")
    p.add_argument("--layers", type=int, default=None, help="KV layers (32: a 32 MiB chunk)")
    add_output_args(p)
    p.set_defaults(func=run_remote)


def run_remote(ns: argparse.Namespace) -> int:
    resolve(ns, samples=(9, 5, 2), layers=(32, 32, 2))
    if ns.samples < 1 or ns.layers < 1:
        print("bench: --samples and --layers must be at least 1", file=sys.stderr)
        return 2
    pair = start_redis()
    if pair is None:
        print("bench remote: redis-server is not installed (make tools)", file=sys.stderr)
        return 2
    proc, raw = pair
    url = f"redis://127.0.0.1:{raw.connection_pool.connection_kwargs['port']}/0"
    common = ["--chunk-size", str(CS), "--l1-size-gb", "2", "--log-level", "error"]
    servers = [
        launch(*common),
        launch(*common, "--remote-url", url, "--remote-write-queue-mb", "2048"),
        launch(*common, "--remote-url", url),
    ]
    try:
        out = _measure(ns, servers, raw)
    finally:
        for s in servers:
            s.stop()
        raw.close()
        proc.kill()
        proc.wait()
    finish(ns, "remote", out, report.show("remote"))
    return 0


def _workers(layers: int, servers: list[BenchServer]) -> list[WorkerAdapter]:
    """One server-driven worker per server (Llama-3-8B's heads), its cache random."""
    heads, head_dim = 8, 128
    workers = []
    for s in servers:
        wait_http(s)
        wait_arena_ready(s)  # the arena's fault-in is another benchmark's subject
        caches = allocate_kv_caches(layers, CS // BS, BS, heads, head_dim, torch.bfloat16)
        for c in caches:
            c.copy_(torch.randn(c.shape).to(torch.bfloat16))
        w = WorkerAdapter(s.endpoint, "bench", heartbeat_interval=5.0)
        w.register_kv_caches(caches)
        workers.append(w)
    return workers


def _measure(ns: argparse.Namespace, servers: list[BenchServer], raw: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    workers = _workers(ns.layers, servers)
    blocks = np.arange(CS // BS)
    rng = np.random.default_rng(7)
    plain_s: list[float] = []
    remote_s: list[float] = []
    retrieve_s: list[float] = []
    get_s: list[float] = []
    try:
        prompts = [rng.integers(0, 50_000, CS) for _ in range(2 * ns.samples)]
        for i in range(ns.samples):
            for w, times, p in (
                (workers[0], plain_s, prompts[2 * i]),
                (workers[1], remote_s, prompts[2 * i + 1]),
            ):
                t0 = time.perf_counter()
                if w.store_detail(p, blocks).stored != 1:
                    raise RuntimeError("bench remote: a STORE was not kept")
                times.append(time.perf_counter() - t0)
        drained(servers[1], ns.samples)
        keys = raw.keys("kvwarden:*")
        for i in range(ns.samples):
            t0 = time.perf_counter()
            if workers[2].retrieve(prompts[2 * i + 1], blocks) != CS:
                raise RuntimeError("bench remote: a remote RETRIEVE missed")
            retrieve_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            value = raw.get(keys[i % len(keys)])
            get_s.append(time.perf_counter() - t0)
        nbytes = len(value)
    finally:
        for w in workers:
            w.close()
    med = statistics.median
    return {
        "params": {"samples": ns.samples, "layers": ns.layers, "chunk_tokens": CS},
        "chunk_bytes": nbytes,
        "store_ms": {"without_remote": 1e3 * med(plain_s), "with_remote": 1e3 * med(remote_s)},
        "store_ratio": med(remote_s) / med(plain_s),
        "retrieve_ms": 1e3 * med(retrieve_s),
        "redis_get_ms": 1e3 * med(get_s),
        "retrieve_ratio": med(retrieve_s) / med(get_s),
        "samples_ms": {
            "store_without_remote": [1e3 * t for t in plain_s],
            "store_with_remote": [1e3 * t for t in remote_s],
            "remote_retrieve": [1e3 * t for t in retrieve_s],
            "redis_get": [1e3 * t for t in get_s],
        },
    }
