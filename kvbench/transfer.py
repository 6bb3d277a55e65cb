"""`kvwarden bench transfer`: full-stack STORE / RETRIEVE throughput beside same-run baselines.

For every transfer mode, chunk size and number of chunks per request a fresh server is started
on free ports; this process is the worker. Three phases follow on that server:

- **starting**: measuring starts as soon as the server answers HELLO (and the worker registered),
  while L1's arena is still being faulted in by its background thread: a burst that reaches a
  server in its first seconds. Each round: memcpy, STORE of a new prompt, RETRIEVE of the
  previous one. Only memcpy is interleaved: a slow baseline between stores would give the
  fault-in thread the time a real burst does not give it. At most half of L1 is used.
- **fresh**: the arena faulted in (polled on `/status`), nothing stored before in the part of L1
  this phase fills: what a server that started before its engines (which load their models for
  longer than the arena takes to fault in) sees for its first gigabytes. No warm-up: every STORE
  writes L1 memory no copy has written before. Rounds as in the starting phase.
- **warm**: L1 filled once, so buffers recycle (steady state). Each round: memcpy, STORE of a
  new prompt, RETRIEVE of a resident one, the chunk over ZMQ, Redis SET and GET of it.

The fresh and warm rounds also take the copy floor (`CopyFloor`): the request's copy made in this
process without a server, so a report separates what the request costs from what the memory does.
Samples of all figures alternate within each round, so machine noise hits them alike; the
report gives medians and, first, their ratios. Unit of work: a chunk of a Llama-3-8B-shaped KV
cache (32 layers x K,V x 8 heads x 128 head dim x bf16 = 128 KiB per token: 64 tokens are 8 MiB,
256 are 32 MiB, 1,024 are 128 MiB). Blocks are assigned at random, as a paged allocator would.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from dataplane.wire.messages import SUPPORTED_DTYPES
from kvbench import report
from kvbench.movers import Baselines, CopyFloor, Mover, Shape, start_redis
from kvbench.procs import BenchServer, arena_view, launch, wait_arena_ready, wait_http, wait_server
from kvbench.results import add_output_args, finish, int_list, resolve

MODES = ("server_driven", "engine_driven")
PHASES = ("starting", "fresh", "warm")


def add_args(sub: Any) -> None:
    t = sub.add_parser(
        "transfer", help="STORE/RETRIEVE GB/s vs memcpy, raw ZMQ and Redis: starting, fresh and warm"
    )
    t.add_argument("--rounds", type=int, default=None, help="samples of each figure per phase (15; quick 3)")
    t.add_argument(
        "--chunks-per-request",
        default=None,
        help="comma-separated: one report per value (1 = one chunk per request, 4 = four); 1,4 (quick 1)",
    )
    t.add_argument("--chunk-sizes", default=None, help="tokens per chunk, comma-separated (64,256,1024)")
    t.add_argument("--chunk-size", type=int, default=None, help="one chunk size (as --chunk-sizes N)")
    t.add_argument("--modes", default=",".join(MODES), help="transfer modes, comma-separated")
    t.add_argument("--phases", default=",".join(PHASES), help="starting, fresh and/or warm, comma-separated")
    t.add_argument("--layers", type=int, default=None, help="default 32")
    t.add_argument("--heads", type=int, default=None, help="KV heads, default 8")
    t.add_argument("--head-dim", type=int, default=None, help="default 128")
    t.add_argument("--block-size", type=int, default=16)
    t.add_argument(
        "--l1-size-gb", type=float, default=None, help="the server's L1 (4, its default; quick 0.5)"
    )
    t.add_argument("--dtype", default="bfloat16", choices=sorted(SUPPORTED_DTYPES))
    t.add_argument("--device", default="cpu", help="cpu or cuda (worker KV memory)")
    t.add_argument(
        "--kv-format",
        default="token_major",
        choices=("token_major", "vllm_cpu"),
        help="the worker's layout: token_major (default), or vllm_cpu (vLLM's CPU blocks, what the "
        "vLLM connector copies into; engine_driven only)",
    )
    t.add_argument("--no-redis", action="store_true", help="skip the Redis baselines")
    add_output_args(t)
    t.set_defaults(func=run_transfer)


def _plan(ns: argparse.Namespace) -> tuple[list[str], list[int], list[int], list[str]]:
    """(modes, chunk sizes, chunks per request, phases); ValueError naming a bad flag."""
    resolve(
        ns,
        rounds=(15, 3, 2),
        chunks_per_request=("1,4", "1", "1"),
        chunk_sizes=("64,256,1024", "64,256,1024", "64"),
        layers=(32, 32, 2),
        heads=(8, 8, 8),
        head_dim=(128, 128, 128),
        l1_size_gb=(4.0, 0.5, 1 / 64),
    )
    sizes = [ns.chunk_size] if ns.chunk_size is not None else int_list(ns.chunk_sizes, "--chunk-sizes")
    cprs = int_list(ns.chunks_per_request, "--chunks-per-request")
    modes = [m.strip() for m in str(ns.modes).split(",") if m.strip()]
    phases = [p.strip() for p in str(ns.phases).split(",") if p.strip()]
    if not modes or not set(modes) <= set(MODES):
        raise ValueError(f"--modes takes {' and/or '.join(MODES)}, got {ns.modes!r}")
    if not phases or not set(phases) <= set(PHASES):
        raise ValueError(f"--phases takes some of {','.join(PHASES)}, got {ns.phases!r}")
    if ns.rounds < 1:
        raise ValueError("--rounds must be at least 1")
    if ns.kv_format == "vllm_cpu" and (modes != ["engine_driven"] or ns.device != "cpu"):
        raise ValueError("--kv-format vllm_cpu takes --modes engine_driven on the cpu device")
    if any(s < 1 or s % ns.block_size for s in sizes):
        raise ValueError("every chunk size must be a positive multiple of --block-size")
    return modes, sizes, cprs, phases


def run_transfer(ns: argparse.Namespace) -> int:
    try:
        modes, sizes, cprs, phases = _plan(ns)
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # memcpy is one thread; workers copy on threads of their own
    base = Baselines(None if ns.no_redis else start_redis())
    rows: list[dict[str, Any]] = []
    try:
        for mode in modes:
            for size in sizes:
                for cpr in cprs:
                    rows += _run_config(ns, base, mode, Shape.of(ns, size, cpr), phases)
    finally:
        base.close()
    params = {
        k: getattr(ns, k)
        for k in (
            "rounds",
            "layers",
            "heads",
            "head_dim",
            "block_size",
            "dtype",
            "device",
            "l1_size_gb",
            "kv_format",
        )
    }
    params["redis"] = base.redis_pair is not None
    finish(ns, "transfer", {"params": params, "rows": rows}, report.print_transfer)
    return 0


def _run_config(
    ns: argparse.Namespace, base: Baselines, mode: str, shape: Shape, phases: list[str]
) -> list[dict[str, Any]]:
    """One fresh server: its starting phase, its fresh phase, then its warm phase."""
    l1_bytes = int(ns.l1_size_gb * (1 << 30))
    if shape.request_bytes > l1_bytes // 2:
        raise RuntimeError(f"a request of {shape.request_bytes} bytes does not fit half an L1 of {l1_bytes}")
    base.resize(shape.chunk_bytes)
    mover = Mover(ns, shape, mode)  # its memory written before the server starts
    floor = CopyFloor(mover) if ns.device == "cpu" and ns.kv_format == "token_major" else None
    server = launch("--chunk-size", str(shape.chunk_tokens), "--l1-size-gb", str(ns.l1_size_gb))
    try:
        wait_server(server.proc, server.endpoint)
        mover.register(server.endpoint)
        rows = []
        rounds = min(ns.rounds, max(1, l1_bytes // 2 // shape.request_bytes))  # half of L1 each
        for phase in ("starting", "fresh"):
            if phase not in phases:
                continue
            if phase == "fresh":
                wait_arena_ready(server)
            samples = _first_fill(mover, base, rounds, floor if phase == "fresh" else None)
            first = {k: v[0] / 1e9 for k, v in samples.items()}  # the very first request's
            extra = {"register_s": mover.register_s, "first_gbps": first, "arena": _arena_after(server)}
            rows.append(_row(mode, phase, shape, rounds, samples, **extra))
        if "warm" in phases:
            rows.append(
                _row(mode, "warm", shape, ns.rounds, _warm(server, mover, base, l1_bytes, ns.rounds, floor))
            )
        return rows
    finally:
        if floor is not None:
            floor.close()
        mover.close()
        server.stop()


def _arena_after(server: BenchServer) -> dict[str, Any]:
    """The arena's state now (after a first-fill phase): was it still being faulted in?"""
    wait_http(server)
    return arena_view(server)


def _first_fill(
    mover: Mover, base: Baselines, rounds: int, floor: CopyFloor | None
) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"memcpy": [], "store": [], "retrieve": []}
    if floor is not None:
        samples |= {"gather": [], "scatter": []}
    prev = None
    for _ in range(rounds):
        samples["memcpy"].append(base.memcpy())
        if floor is not None:
            samples["gather"].append(floor.gather())
            samples["scatter"].append(floor.scatter())
        prompt = mover.prompt()
        samples["store"].append(mover.store(prompt))
        samples["retrieve"].append(mover.retrieve(prompt if prev is None else prev))
        prev = prompt
    return samples


def _warm(
    server: BenchServer, mover: Mover, base: Baselines, l1_bytes: int, rounds: int, floor: CopyFloor | None
) -> dict[str, list[float]]:
    wait_arena_ready(server)
    for _ in range(math.ceil(l1_bytes / mover.shape.request_bytes) + 1):  # L1 full: buffers recycle
        mover.store(mover.prompt())
    others = base.others()
    for fn in others.values():  # connections up, buffers touched
        fn()
    resident = mover.prompt()
    fns: dict[str, Callable[[], float]] = {
        "memcpy": base.memcpy,
        **({} if floor is None else {"gather": floor.gather, "scatter": floor.scatter}),
        "store": lambda: mover.store(mover.prompt()),
        "retrieve": lambda: mover.retrieve(resident),
        **others,
    }
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        mover.store(resident)  # present: keeps the retrieved prompt the newest in L1
        for name, fn in fns.items():
            samples[name].append(fn())
    return samples


def _row(
    mode: str, phase: str, shape: Shape, rounds: int, samples: dict[str, list[float]], **extra: Any
) -> dict[str, Any]:
    med = {k: statistics.median(v) / 1e9 for k, v in samples.items()}
    ratios = {
        "store_vs_memcpy": med["store"] / med["memcpy"],
        "retrieve_vs_memcpy": med["retrieve"] / med["memcpy"],
    }
    if "gather" in med:
        ratios["store_vs_gather"] = med["store"] / med["gather"]
        ratios["retrieve_vs_scatter"] = med["retrieve"] / med["scatter"]
    if "zmq" in med:
        ratios["store_vs_zmq"] = med["store"] / med["zmq"]
        ratios["retrieve_vs_zmq"] = med["retrieve"] / med["zmq"]
    if "redis_set" in med:
        ratios["store_vs_redis_set"] = med["store"] / med["redis_set"]
        ratios["retrieve_vs_redis_get"] = med["retrieve"] / med["redis_get"]
    return {
        "mode": mode,
        "phase": phase,
        "chunk_tokens": shape.chunk_tokens,
        "chunk_bytes": shape.chunk_bytes,
        "chunks_per_request": shape.chunks_per_request,
        "rounds": rounds,
        "ratios": ratios,
        "gbps": med,
        "spread_gbps": {k: [min(v) / 1e9, max(v) / 1e9] for k, v in samples.items()},
        **extra,
    }
