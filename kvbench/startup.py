"""`kvwarden bench startup`: from starting ``kvwarden serve`` to its first PING answered.

A DEALER socket connects (retrying every few milliseconds) before the server process starts and
has a PING queued; the figure is the time from starting the process to that reply. Then the
server's memory (resident set, and what its segments occupy in ``/dev/shm``) is read at once,
and again when its L1 arena is reserved and faulted in (not with ``--quick``). Beside each
start, in the same run: how long this interpreter takes to start at all, and to import torch
(what any start pays).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

from kvbench import report
from kvbench.procs import launch_pinged, memory_of, wait_arena_ready, wait_http
from kvbench.results import add_output_args, finish, resolve


def add_args(sub: Any) -> None:
    p = sub.add_parser("startup", help="server start to first PING with a 4 GiB L1; its RSS and /dev/shm")
    p.add_argument("--rounds", type=int, default=None, help="server starts (3; quick 1)")
    p.add_argument("--l1-size-gb", type=float, default=None, help="default 4")
    p.add_argument(
        "--arena-ready",
        choices=("wait", "skip"),
        default=None,
        help="wait for the arena to be faulted in, then read memory again (wait; quick skip: a "
        "4 GiB arena takes 2-15 s to fault in on 2-core machines)",
    )
    add_output_args(p)
    p.set_defaults(func=run_startup)


def run_startup(ns: argparse.Namespace) -> int:
    resolve(ns, rounds=(3, 1, 1), l1_size_gb=(4.0, 4.0, 1 / 16), arena_ready=("wait", "skip", "wait"))
    if ns.rounds < 1:
        print("bench: --rounds must be at least 1", file=sys.stderr)
        return 2
    runs, python_s, torch_s = [], [], []
    for _ in range(ns.rounds):
        python_s.append(_run_python("pass"))
        torch_s.append(_run_python("import torch"))
        runs.append(_one_start(ns.l1_size_gb, ns.arena_ready == "wait"))
    ready = [r["arena_ready_s"] for r in runs if r["arena_ready_s"] is not None]
    out = {
        "params": {"rounds": ns.rounds, "l1_size_gb": ns.l1_size_gb, "arena_ready": ns.arena_ready},
        "first_ping_s": statistics.median(r["first_ping_s"] for r in runs),
        "arena_ready_s": statistics.median(ready) if ready else None,
        "python_s": statistics.median(python_s),
        "import_torch_s": statistics.median(torch_s),
        "runs": runs,
    }
    finish(ns, "startup", out, report.show("startup"))
    return 0


def _run_python(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - t0


def _one_start(l1_gb: float, wait_arena: bool) -> dict[str, Any]:
    server, first_ping = launch_pinged("--l1-size-gb", str(l1_gb))
    try:
        at_ping = memory_of(server.proc.pid)
        out: dict[str, Any] = {"first_ping_s": first_ping, "memory_at_first_ping": at_ping}
        if not wait_arena:
            return out | {"arena_ready_s": None, "arena": None, "memory_arena_ready": None}
        wait_http(server)
        arena = wait_arena_ready(server)
        ready = time.perf_counter() - server.started
        return out | {
            "arena_ready_s": ready,
            "arena": arena,
            "memory_arena_ready": memory_of(server.proc.pid),
        }
    finally:
        server.stop()
