"""An HTTP load generator for `kvwarden bench http`, run as its own process (its own GIL):

    python -m kvbench.loadgen URL paced RATE   # GET /status RATE times a second
    python -m kvbench.loadgen URL closed       # GET /status, /metrics, ... back to back
    python -m kvbench.loadgen URL spin         # no requests: one core kept busy

``spin`` is the yardstick for the closed loop: it keeps a core as busy as a client does, without
a request, so PING meanwhile shows what the machine's scheduler alone costs.

It prints ``ready`` once its first request was answered, runs until its standard input closes,
then prints one JSON line: the latencies (seconds) by route, errors and requests issued.
Paced requests come from a thread pool, so a slow answer does not delay the next request.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class _Load:
    def __init__(self, url: str) -> None:
        self.url = url
        self.lat: dict[str, list[float]] = {"/status": [], "/metrics": []}
        self.errors = 0
        self.issued = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def one(self, route: str) -> None:
        t0 = time.perf_counter()
        try:
            with urllib.request.urlopen(self.url + route, timeout=30) as r:
                r.read()
            took = time.perf_counter() - t0
            with self.lock:
                self.lat[route].append(took)
        except OSError:
            with self.lock:
                self.errors += 1

    def paced(self, rate: float) -> None:
        """GET /status ``rate`` times a second until stopped; a backlog is dropped at the end."""
        pool = ThreadPoolExecutor(8)
        start = time.perf_counter()
        i = 0
        while not self.stop.is_set():
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                self.stop.wait(delay)  # pacing, not waiting for readiness
            pool.submit(self.one, "/status")
            i += 1
        self.issued = i
        pool.shutdown(wait=True, cancel_futures=True)

    def closed(self) -> None:
        """GET /status and /metrics alternately, one at a time, until stopped."""
        while not self.stop.is_set():
            for route in ("/status", "/metrics"):
                self.one(route)
                self.issued += 1

    def spin(self) -> None:
        """Keep one core busy (pure Python, this process's own GIL) until stopped."""
        n = 0
        while not self.stop.is_set():
            for _ in range(10_000):
                n += 1
        self.issued = n

    def result(self) -> dict[str, Any]:
        with self.lock:
            return {"latency_s": self.lat, "errors": self.errors, "issued": self.issued}


def main(argv: list[str]) -> int:
    url, mode = argv[0], argv[1]
    load = _Load(url)
    if mode != "spin":
        load.one("/status")  # connected and answered once
        load.lat["/status"].clear()
    print("ready", flush=True)
    modes = {"paced": lambda: load.paced(float(argv[2])), "closed": load.closed, "spin": load.spin}
    target = modes[mode]
    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    sys.stdin.read()  # until the benchmark closes our standard input
    load.stop.set()
    worker.join(60)
    print(json.dumps(load.result()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
