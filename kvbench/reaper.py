"""`kvwarden bench reaper`: reap cycles with 1,000 to 100,000 tracked instances, PING meanwhile.

For each count in ``--instances``, a real data plane runs in this process with one extra
liveness target: a registry holding that many entries (no memory behind them). Each cycle adds
1% stale entries and runs the reaper's step (collect and pop in slices, the release path, the
fan-out), back to back, while a separate process PINGs the server, whose PING takes the same
registry lock. Reports each count's cycle time and PING p50/p99, idle and during the cycles.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from typing import Any

from dataplane.liveness.entry import Entry, InstanceInfo
from dataplane.liveness.reaper import WorkerReaper
from dataplane.liveness.registry import LivenessRegistry
from dataplane.server.config import SWITCH_INTERVAL_S, Settings
from dataplane.server.gcfreeze import CollectorFreezer
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.wire.messages import MemoryKind, TransferMode
from kvbench import report
from kvbench.procs import free_port
from kvbench.results import add_output_args, finish, int_list, resolve

PINGER = r"""
import sys, time, zmq
from dataplane.wire.messages import Ping
from dataplane.wire.protocol import encode_message
ctx = zmq.Context(); d = ctx.socket(zmq.DEALER); d.connect(sys.argv[1])
frame = encode_message(1, Ping(5, bytes(16))); ts = []
d.send(frame); d.recv(); print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    t0 = time.perf_counter(); d.send(frame); d.recv(); ts.append(time.perf_counter() - t0)
    time.sleep(0.0005)
ts.sort(); print(f"{ts[len(ts) // 2] * 1e6:.0f} {ts[int(len(ts) * .99)] * 1e6:.0f} {len(ts)}")
"""
_INFO = InstanceInfo(TransferMode.SERVER_DRIVEN.value, MemoryKind.SHM.value, "m", 1, 0, 1, 32, "bfloat16")


def add_args(sub: Any) -> None:
    p = sub.add_parser("reaper", help="reap cycle time and PING p99 with up to 100,000 tracked instances")
    p.add_argument("--instances", default=None, help="tracked instances, comma-separated (1000,10000,100000)")
    p.add_argument("--seconds", type=float, default=None, help="length of each PING block (3; quick 1)")
    add_output_args(p)
    p.set_defaults(func=run_reaper)


def _release_nothing(e: Entry, why: str) -> None:
    return None


def _pinger(endpoint: str, seconds: float) -> subprocess.Popen[str]:
    p = subprocess.Popen(
        [sys.executable, "-c", PINGER, endpoint, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None
    p.stdout.readline()  # ready: connected and answered once
    return p


def _pings(p: subprocess.Popen[str]) -> dict[str, float]:
    p50, p99, n = p.communicate()[0].split()
    return {"n": int(n), "p50_us": float(p50), "p99_us": float(p99)}


def run_reaper(ns: argparse.Namespace) -> int:
    resolve(ns, instances=("1000,10000,100000", "1000,10000,100000", "1000,10000"), seconds=(3.0, 1.0, 0.3))
    try:
        counts = int_list(ns.instances, "--instances")
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    logging.disable(logging.WARNING)  # reap warnings would measure the log handler
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as `kvwarden serve` runs
    runs = [_one_count(ns, n) for n in counts]
    finish(ns, "reaper", {"params": {"seconds": ns.seconds}, "runs": runs}, report.show("reaper"))
    return 0


def _one_count(ns: argparse.Namespace, n: int) -> dict[str, Any]:
    """A fresh data plane with ``n`` tracked: a small L1 (its fault-in is soon over) and no
    reaper thread of its own (it would race the measured step for the stale entries)."""
    synthetic: LivenessRegistry[Entry] = LivenessRegistry("synthetic", _release_nothing)
    settings = {"port": free_port(), "http_port": free_port(), "l1_size_gb": 1 / 64}
    settings |= {"worker_reap_timeout_seconds": 0, "worker_disconnect_grace_seconds": 0}
    dp = build_dataplane(Settings.model_validate(settings), extra_targets=[synthetic])
    dp.start()
    freezer = CollectorFreezer()  # as `kvwarden serve` runs one
    freezer.start()
    try:
        return _measure(n, ns.seconds, dp, synthetic)
    finally:
        freezer.stop()
        freezer.join()
        dp.stop()


def _measure(n: int, seconds: float, dp: DataPlane, synthetic: LivenessRegistry[Entry]) -> dict[str, Any]:
    stale_n = max(1, n // 100)
    now = time.monotonic()
    for i in range(n - stale_n):
        synthetic.put(Entry(i, now, now, b"", _INFO, has_liveness_signal=True), "bench")
    reaper = WorkerReaper(dp.management.releaser, 120.0, 3600.0, 0.0)  # its step, no thread
    endpoint = dp.server_info().endpoint
    idle = _pings(_pinger(endpoint, seconds))
    times: list[float] = []
    busy = _pinger(endpoint, seconds)
    k = 0
    while busy.poll() is None:  # reap cycles back to back for as long as the pinger runs
        t = time.monotonic() - 1000.0  # 1% of the instances went silent long ago
        for i in range(n + k * stale_n, n + (k + 1) * stale_n):
            synthetic.put(Entry(i, t, t, b"", _INFO, has_liveness_signal=True), "bench")
        t0 = time.perf_counter()
        reaped = reaper.reap_once()
        times.append(time.perf_counter() - t0)
        if len(reaped) != stale_n:
            raise RuntimeError(f"a cycle reaped {len(reaped)} instances, not {stale_n}")
        k += 1
    times.sort()
    return {
        "instances": n,
        "ping_idle": idle,
        "cycle_ms": {
            "n": len(times),
            "stale": stale_n,
            "p50": times[len(times) // 2] * 1e3,
            "max": times[-1] * 1e3,
        },
        "ping_during_cycles": _pings(busy),
    }
