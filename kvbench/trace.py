"""`kvwarden bench trace`: a request trace replayed against a real kvwarden server, its hit rate
beside the same trace through plain LRU and through the offline optimum (both simulated).

For each capacity (a share of the trace's distinct full blocks) a fresh server is started with
exactly that many chunks of L1 (``--chunk-size 512``: one trace block, one chunk) and one
server-driven worker replays every request: LOOKUP (the hit), RETRIEVE of the hit prefix, STORE
of the prompt (`kvbench.trace_sim` has the sequence and the simulated policies). Token ids come
from the block ids (`kvbench.trace_data`), so shared prefixes share tokens. The KV is small
(one layer, one head of 16: 32 KiB a chunk): the subject is which chunks are kept, not bytes.

Figures per capacity: the server's hit rate (blocks and tokens) under ``--policy`` (its
``l1_eviction``: lru, the default, or lfuda), the simulator's under that policy, under LRU and
under the optimum, the server's minus the simulated same policy's (the simulator may not
flatter: within one point), bytes moved, requests per second and the server's CPU time per
request. As fast as it goes unless ``--pace`` (the trace's own timestamps, ``--speed`` times
faster).

    kvwarden bench trace --trace ../shared/data/conversation_trace.jsonl --limit 3000
    kvwarden bench trace --generate 2000 --capacities 0.05,0.1,0.25 --policy lfuda
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.storage.evict import POLICIES
from kvbench import report
from kvbench.procs import BenchServer, launch, wait_arena_ready, wait_http
from kvbench.results import add_output_args, finish, resolve
from kvbench.trace_data import (
    BLOCK_TOKENS,
    TraceRequest,
    TraceShape,
    generate,
    load,
    prompt_tokens,
    unique_full_blocks,
)
from kvbench.trace_sim import simulate

BS, HEADS, HEAD_DIM = 16, 1, 16
CHUNK_BYTES = 2 * BLOCK_TOKENS * HEADS * HEAD_DIM * 2  # one layer, K and V, bf16
# with --kv-compression int8: a layer as SmolLM2-135M's (3 KV heads of 64): 1.94x in int8 (a
# head of 16 would spend a third of an int8 chunk on its values' per-token parameters)
INT8_HEADS, INT8_HEAD_DIM = 3, 64


def add_args(sub: Any) -> None:
    p = sub.add_parser(
        "trace", help="replay a request trace: hit rate vs LRU and the optimum at each capacity"
    )
    p.add_argument("--trace", type=Path, default=None, help="a trace file (Mooncake JSON lines)")
    p.add_argument("--generate", type=int, default=None, help="requests of a generated trace (no --trace)")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed")
    p.add_argument("--limit", type=int, default=None, help="replay the first N requests of --trace")
    p.add_argument(
        "--capacities", default=None, help="shares of the distinct full blocks (0.01,0.05,0.1,0.25)"
    )
    p.add_argument(
        "--policy", choices=POLICIES, default="lru", help="the server's l1_eviction (lru; or lfuda)"
    )
    p.add_argument(
        "--kv-compression",
        choices=("none", "int8"),
        default="none",
        help="int8: the worker stores int8 chunks (kv_compression) of a 3 x 64 head layer into the "
        "same L1 bytes as raw ones; the rows add LRU at the chunks that fit",
    )
    p.add_argument("--pace", action="store_true", help="follow the trace's timestamps")
    p.add_argument("--speed", type=float, default=1.0, help="with --pace: this many times faster")
    add_output_args(p)
    p.set_defaults(func=run_trace)


def run_trace(ns: argparse.Namespace) -> int:
    resolve(ns, capacities=("0.01,0.05,0.1,0.25", "0.05,0.1,0.25", "0.1,0.5"), generate=(2000, 1000, 120))
    try:
        caps = [float(v) for v in str(ns.capacities).split(",") if v.strip()]
        if not caps or not all(0 < c <= 1 for c in caps):
            raise ValueError
    except ValueError:
        print(f"bench trace: --capacities takes shares in (0, 1], got {ns.capacities!r}", file=sys.stderr)
        return 2
    if ns.speed <= 0 or (ns.limit is not None and ns.limit < 1):
        print("bench trace: --speed must be > 0 and --limit >= 1", file=sys.stderr)
        return 2
    try:
        reqs = (
            load(ns.trace, ns.limit)
            if ns.trace is not None
            else generate(TraceShape(ns.generate, seed=ns.seed))
        )
    except (OSError, ValueError) as exc:
        print(f"bench trace: {exc}", file=sys.stderr)
        return 2
    unique = unique_full_blocks(reqs)
    rows = [_capacity(ns, reqs, share, max(1, int(share * unique))) for share in caps]
    out = {
        "trace": str(ns.trace)
        if ns.trace is not None
        else f"generated ({ns.generate} requests, seed {ns.seed})",
        "requests": len(reqs),
        "unique_blocks": unique,
        "chunk_bytes": _shape(ns)[2],
        "kv_compression": ns.kv_compression,
        "paced": bool(ns.pace),
        "policy": ns.policy,
        "rows": rows,
        "max_sim_gap_points": max(abs(r["server_vs_sim_points"]) for r in rows),
    }
    finish(ns, "trace", out, _show)
    return 0


def _shape(ns: argparse.Namespace) -> tuple[int, int, int]:
    """(KV heads, head dim, bytes of a raw chunk) of the replay's one layer."""
    heads, dim = (INT8_HEADS, INT8_HEAD_DIM) if ns.kv_compression == "int8" else (HEADS, HEAD_DIM)
    return heads, dim, 2 * BLOCK_TOKENS * heads * dim * 2


def _capacity(ns: argparse.Namespace, reqs: list[TraceRequest], share: float, cap: int) -> dict[str, Any]:
    """A replay with L1 as large as ``cap`` raw chunks (``share`` of the distinct blocks)."""
    lru, opt = simulate(reqs, cap, "lru"), simulate(reqs, cap, "optimum")
    sim = lru if ns.policy == "lru" else simulate(reqs, cap, ns.policy)
    raw_bytes = _shape(ns)[2]
    gb = (cap * raw_bytes + raw_bytes // 2) / (1 << 30)  # exactly `cap` raw chunks
    flags = ("--chunk-size", str(BLOCK_TOKENS), "--l1-size-gb", f"{gb:.12f}", "--l1-eviction", ns.policy)
    server = launch(*flags, "--log-level", "error")
    try:
        wait_http(server)
        wait_arena_ready(server)
        got = _replay(ns, server, reqs)
    finally:
        server.stop()
    held = cap
    if ns.kv_compression != "none":  # as many int8 chunks as the same bytes hold: LRU at those
        held = got["held_chunks"]
        sim = simulate(reqs, held, ns.policy)
    rate = got["hit_blocks"] / max(1, lru.blocks)
    return {
        "share": share,
        "capacity_chunks": cap,
        "held_chunks": held,
        "server": {"block_rate": rate, "token_rate": got["hit_tokens"] / max(1, lru.tokens), **got},
        "simulated": {"block_rate": sim.block_rate, "token_rate": sim.token_rate, "evictions": sim.evictions},
        "lru": {"block_rate": lru.block_rate, "token_rate": lru.token_rate, "evictions": lru.evictions},
        "optimum": {"block_rate": opt.block_rate, "token_rate": opt.token_rate},
        "server_vs_sim_points": 100 * (rate - sim.block_rate),
        "server_vs_lru_points": 100 * (rate - lru.block_rate),
    }


def _replay(ns: argparse.Namespace, server: BenchServer, reqs: list[TraceRequest]) -> dict[str, Any]:
    longest = max(r.input_length for r in reqs)
    n_blocks = -(-longest // BS) + 1
    heads, dim, raw_bytes = _shape(ns)
    caches = allocate_kv_caches(1, n_blocks, BS, heads, dim, torch.bfloat16)
    int8 = ns.kv_compression == "int8"  # (quantized by the worker: engine-driven)
    mode = "engine_driven" if int8 else "server_driven"
    w = WorkerAdapter(
        server.endpoint, "trace", transfer_mode=mode, heartbeat_interval=5.0, kv_compression=ns.kv_compression
    )
    w.register_kv_caches(caches)
    blocks = np.arange(n_blocks)
    hit_blocks = hit_tokens = stored = 0
    cpu0, t0 = _cpu(server), time.perf_counter()
    start_ts = reqs[0].timestamp_ms
    try:
        for r in reqs:
            if ns.pace:
                due = t0 + (r.timestamp_ms - start_ts) / 1e3 / ns.speed
                time.sleep(max(0.0, due - time.perf_counter()))  # the trace's own pacing
            tokens = prompt_tokens(r)
            hit = w.lookup(tokens)
            if hit:
                hit = w.retrieve(tokens[:hit], blocks)
            hit_tokens += hit
            hit_blocks += hit // BLOCK_TOKENS
            stored += w.store_detail(tokens, blocks).stored
        took = time.perf_counter() - t0
        cpu = _cpu(server) - cpu0
        l1 = server.json("/status")["storage"]["l1"]
    finally:
        w.close()
    return {
        "hit_blocks": hit_blocks,
        "hit_tokens": hit_tokens,
        "stored_chunks": stored,
        "held_chunks": l1["chunks"],  # (L1 is full by the end of a replay)
        "l1_used_bytes": l1["used_bytes"],
        "bytes_moved": (hit_blocks + stored) * raw_bytes,
        "requests_per_s": len(reqs) / took,
        "server_cpu_ms_per_request": 1e3 * cpu / len(reqs),
    }


def _cpu(server: BenchServer) -> float:
    """The server process's CPU seconds so far (user and system)."""
    fields = Path(f"/proc/{server.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _show(rep: dict[str, Any]) -> None:
    rows = []
    for r in rep["rows"]:
        s = r["server"]
        rows.append(
            [
                f"{100 * r['share']:g}% ({r['capacity_chunks']:,}; {r['held_chunks']:,} held)",
                f"{100 * s['block_rate']:.1f}% / {100 * s['token_rate']:.1f}%",
                f"{100 * r['simulated']['block_rate']:.1f}%",
                f"{100 * r['lru']['block_rate']:.1f}%",
                f"{100 * r['optimum']['block_rate']:.1f}%",
                f"{r['server_vs_sim_points']:+.2f}",
                f"{s['requests_per_s']:.0f}",
                f"{s['bytes_moved'] / (1 << 20):.0f}",
                f"{s['server_cpu_ms_per_request']:.2f}",
            ]
        )
    t = report.Table(
        f"{rep['trace']}: {rep['requests']:,} requests, {rep['unique_blocks']:,} distinct full blocks, "
        f"the server's l1_eviction {rep['policy']}, {rep['kv_compression']} chunks (hit rate: blocks / "
        "tokens; the rest simulated: the policy at the chunks held, LRU and the optimum at the raw)",
        [
            "capacity (chunks)",
            "server",
            f"{rep['policy']} (sim)",
            "LRU",
            "optimum",
            "server - sim",
            "req/s",
            "MiB moved",
            "CPU ms/req",
        ],
        rows,
    )
    print(report.text(t), flush=True)
