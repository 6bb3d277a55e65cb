"""`kvwarden bench blend`: BLEND_STORE and BLEND_RETRIEVE beside plain STORE and RETRIEVE.

For each transfer mode a fresh server is started; this process is the worker (Llama-3-8B-shaped
chunks, 32 MiB at 256 tokens; RoPE theta 500,000, NeoX pairs, full rotary dim). What a user
meets first is measured first: the very first BLEND_STORE and BLEND_RETRIEVE right after
BLEND_REGISTER, while the server may still be compiling its rotation kernels (the state is
recorded beside each; an engine-driven worker whose server shares L1 rotates itself, with
kernels of its own, compiled in this process after its first blend registration). Then, all
kernels ready and L1's arena faulted in, each round takes one sample of every figure in turn:
memcpy of the chunk, plain RETRIEVE of a resident chunk, blend RETRIEVE of a resident blend
chunk at a new position, plain STORE and blend STORE of new chunks. The report gives medians
and their ratios (blend time / plain time: the cost of the rotation).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from dataplane.memory import rope_kernel
from dataplane.memory.rope import RopeParams
from kvbench import report
from kvbench.movers import Baselines, Mover, Shape
from kvbench.procs import BenchServer, launch, wait_arena_ready, wait_ready, wait_server
from kvbench.results import add_output_args, finish, resolve

MODES = ("server_driven", "engine_driven")
FIGURES = ("memcpy", "retrieve", "blend_retrieve", "store", "blend_store")


def add_args(sub: Any) -> None:
    p = sub.add_parser("blend", help="BLEND_STORE/RETRIEVE (keys re-rotated) vs plain STORE/RETRIEVE")
    p.add_argument("--rounds", type=int, default=None, help="samples of each figure (15; quick 5)")
    p.add_argument("--chunk-size", type=int, default=None, help="tokens per chunk (256: 32 MiB)")
    p.add_argument("--layers", type=int, default=None, help="default 32")
    p.add_argument("--modes", default=",".join(MODES), help="transfer modes, comma-separated")
    add_output_args(p)
    p.set_defaults(func=run_blend)


def run_blend(ns: argparse.Namespace) -> int:
    resolve(ns, rounds=(15, 5, 2), chunk_size=(256, 256, 32), layers=(32, 32, 2))
    modes = [m.strip() for m in str(ns.modes).split(",") if m.strip()]
    if not modes or not set(modes) <= set(MODES) or ns.rounds < 1 or ns.chunk_size % 16:
        print(
            f"bench: --modes takes {' and/or '.join(MODES)}, --rounds >= 1, --chunk-size a multiple of 16",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(1)
    ns.heads, ns.head_dim, ns.dtype, ns.block_size, ns.device = 8, 128, "bfloat16", 16, "cpu"
    shape = Shape.of(ns, ns.chunk_size, 1)
    base = Baselines(None)
    base.resize(shape.chunk_bytes)
    try:
        rows = [_run_mode(ns, base, mode, shape) for mode in modes]
    finally:
        base.close()
    params = {"rounds": ns.rounds, "chunk_tokens": ns.chunk_size, "layers": ns.layers, "dtype": ns.dtype}
    params["rope"] = vars(_rope())
    out = {"params": params, "chunk_bytes": shape.chunk_bytes, "rows": rows}
    finish(ns, "blend", out, report.show("blend"))
    return 0


def _rope() -> RopeParams:
    return RopeParams(128, 500000.0, "neox", 1.0, 32768)


def _kernel_state(server: BenchServer) -> str:
    return str(server.json("/status")["worker_liveness"]["blend_kernel"])


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _run_mode(ns: argparse.Namespace, base: Baselines, mode: str, shape: Shape) -> dict[str, Any]:
    gb = max(1.0, 4 * (ns.rounds + 4) * shape.chunk_bytes / (1 << 30))
    mover = Mover(ns, shape, mode)
    server = launch("--chunk-size", str(shape.chunk_tokens), "--l1-size-gb", f"{gb:.2f}")
    try:
        wait_server(server.proc, server.endpoint)
        mover.register(server.endpoint)
        w, n = mover.adapter, shape.blocks
        w.register_blend(_rope())
        first: dict[str, Any] = {"kernel_at_first_store": _kernel_state(server)}
        first["worker_kernels_at_first_store"] = rope_kernel.compiled()  # (engine-driven: it rotates)
        blend_prompt = mover.prompt()
        took, r = _timed(lambda: w.store_blend(blend_prompt, mover.rng.permutation(n), 0))
        first["blend_store_ms"] = took * 1e3
        first["kernel_at_first_retrieve"] = _kernel_state(server)
        took, hits = _timed(lambda: w.retrieve_blend(blend_prompt, n + mover.rng.permutation(n), 512))
        first["blend_retrieve_ms"] = took * 1e3
        if r.stored != 1 or hits != [(0, True)]:
            raise RuntimeError(f"blend: the first chunk was not stored and found again ({r}, {hits})")
        wait_ready(lambda: _compiled(server), server.proc, 300.0)
        if (state := _kernel_state(server)) != "ready":
            raise RuntimeError(f"blend: the server's rotation kernels are {state}")
        if mode == "engine_driven":  # this process is the worker, and rotates for one-copy blend
            wait_ready(_worker_compiled, server.proc, 300.0)
        wait_arena_ready(server)
        return {"mode": mode, "first": first, **_rounds(ns, base, mover)}
    finally:
        mover.close()
        server.stop()


def _worker_compiled() -> None:
    if not rope_kernel.compiled():
        raise RuntimeError("this worker's blend kernels are compiling")


def _compiled(server: BenchServer) -> None:
    if _kernel_state(server) == "compiling":
        raise RuntimeError("the blend kernels are compiling")


def _rounds(ns: argparse.Namespace, base: Baselines, mover: Mover) -> dict[str, Any]:
    w, n, cs = mover.adapter, mover.shape.blocks, mover.shape.chunk_tokens
    resident, blend_resident = mover.prompt(), mover.prompt()
    mover.store(resident)
    w.store_blend(blend_resident, mover.rng.permutation(n), 0)
    ms: dict[str, list[float]] = {k: [] for k in FIGURES}
    for i in range(ns.rounds):
        at = 512 + i * cs
        ms["memcpy"].append(mover.shape.chunk_bytes / base.memcpy() * 1e3)
        ms["retrieve"].append(mover.shape.chunk_bytes / mover.retrieve(resident) * 1e3)
        took, hits = _timed(lambda: w.retrieve_blend(blend_resident, n + mover.rng.permutation(n), at))  # noqa: B023
        if hits != [(0, True)]:
            raise RuntimeError(f"blend RETRIEVE missed its resident chunk: {hits}")
        ms["blend_retrieve"].append(took * 1e3)
        ms["store"].append(mover.shape.chunk_bytes / mover.store(mover.prompt()) * 1e3)
        p = mover.prompt()
        took, r = _timed(lambda: w.store_blend(p, mover.rng.permutation(n), at))  # noqa: B023
        if r.stored != 1:
            raise RuntimeError(f"blend STORE did not store its new chunk: {r}")
        ms["blend_store"].append(took * 1e3)
    med = {k: statistics.median(v) for k, v in ms.items()}
    return {
        "ms": med,
        "spread_ms": {k: [min(v), max(v)] for k, v in ms.items()},
        "ratios": {
            "blend_retrieve_vs_retrieve": med["blend_retrieve"] / med["retrieve"],
            "blend_store_vs_store": med["blend_store"] / med["store"],
            "blend_retrieve_vs_memcpy": med["blend_retrieve"] / med["memcpy"],
        },
        "samples_ms": ms,
    }
