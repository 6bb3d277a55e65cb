#!/usr/bin/env python3
"""Reaper cost at scale: 100,000 tracked instances, 1% going stale per cycle.

A real server (in this process) with a synthetic liveness target holding 100,000 entries; a
separate process PINGs the server throughout. Prints each reap cycle's time (collect, pop and
release of 1,000 stale entries) and PING p50/p99, idle and while the cycles run.

    .venv/bin/python scripts/bench_reaper.py
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dataplane.config import Settings  # noqa: E402
from dataplane.modules.registry import Entry, InstanceInfo, LivenessRegistry  # noqa: E402
from dataplane.runtime import build_dataplane  # noqa: E402
from tests.helpers import free_port  # noqa: E402

INSTANCES, CYCLES = 100_000, 8
PINGER = r"""
import sys, time, zmq
from dataplane.protocol import encode_request
ctx = zmq.Context(); d = ctx.socket(zmq.DEALER); d.connect(sys.argv[1])
frame = encode_request(1, "PING", [5]); ts = []
d.send(frame); d.recv(); print("ready", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    t0 = time.perf_counter(); d.send(frame); d.recv(); ts.append(time.perf_counter() - t0)
    time.sleep(0.0005)
ts.sort(); print(f"n={len(ts)} p50={ts[len(ts) // 2] * 1e6:.0f}us p99={ts[int(len(ts) * .99)] * 1e6:.0f}us")
"""


class Synthetic(LivenessRegistry[Entry]):
    name = "synthetic"


def main() -> None:
    logging.disable(logging.WARNING)  # reap warnings would measure the log handler
    sys.setswitchinterval(0.001)  # as `kvwarden serve` runs
    dp = build_dataplane(Settings(port=free_port(), http_port=free_port()))
    syn: Synthetic = Synthetic(clock=dp.clock)
    dp.management.targets.append(syn)
    dp.start()
    info = InstanceInfo("server_driven", "shm", "m", 1, 0, 1, 32, "bfloat16")
    now = time.monotonic()
    for i in range(INSTANCES):
        syn._entries[i] = Entry(i, now, now, b"", info, has_liveness_signal=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def pinger(seconds: float) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", PINGER, dp.server.bound_endpoint,
                              str(seconds)], stdout=subprocess.PIPE, text=True, env=env)
        assert p.stdout is not None
        p.stdout.readline()  # ready: connected and answered once
        return p

    idle = pinger(3)
    print(f"{INSTANCES} tracked; PING idle: {idle.communicate()[0].strip()}")
    times: list[float] = []
    busy = pinger(3)
    k = 0
    while busy.poll() is None:  # reap cycles back to back for as long as the pinger runs
        t = time.monotonic()
        stale = range((k % 100) * INSTANCES // 100, (k % 100 + 1) * INSTANCES // 100)
        with syn._lock:
            for i in stale:
                syn._entries[i].last_seen = t - 1000  # 1% stale this cycle
        t0 = time.perf_counter()
        syn.reap_stale_instances(120, 3600)
        times.append(time.perf_counter() - t0)
        with syn._lock:  # back to 100,000 for the next cycle
            for i in stale:
                syn._entries[i] = Entry(i, t, t, b"", info, has_liveness_signal=True)
        k += 1
    times.sort()
    print(f"{len(times)} reap cycles of 1,000 stale: p50 {times[len(times) // 2] * 1e3:.0f} ms, "
          f"max {times[-1] * 1e3:.0f} ms")
    print(f"PING during the cycles: {busy.communicate()[0].strip()}")
    dp.stop()


if __name__ == "__main__":
    main()
