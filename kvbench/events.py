"""`kvwarden bench events`: KV events and the router's lookup, beside the same server without them.

Two fresh servers (no warm-up): P (events off) and E (``--kv-events-endpoint``, a subscriber
attached that reads every message and checks the sequence numbers), each with an L1 of
``--l1-chunks`` chunks, so that stores evict and both BlockStored and BlockRemoved flow.

- **STORE latency, events on vs off**: distinct one-chunk STOREs through P and E in turn (who
  goes first alternates): the median ratio E / P (target <= 1.05).
- **Events/s while STOREs run**: ``--burst`` one-chunk STOREs through E as fast as one worker
  goes; the events published (from E's ``/metrics``) over the burst's time, and what the
  subscriber (a process of its own) received (gaps, if it lost any).
- **Lookups**: ``POST /v1/lookup`` batches of ``--batch`` prompts of ``--prompt-tokens`` tokens
  (half held in L1), one client: batches/s, prompts/s and the median batch latency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

import numpy as np
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from kvbench import report
from kvbench.procs import BenchServer, free_port, launch, wait_arena_ready, wait_http
from kvbench.results import add_output_args, finish, resolve

BS, CS = 16, 256
BLOCKS = np.arange(CS // BS)
MODEL, HEADS, HEAD_DIM = "bench", 8, 128


def add_args(sub: Any) -> None:
    p = sub.add_parser("events", help="KV events: STORE latency with them on vs off, events/s, /v1/lookup")
    p.add_argument("--samples", type=int, default=None, help="STOREs per server (200; quick 60)")
    p.add_argument("--burst", type=int, default=None, help="STOREs of the events/s burst (2,000; quick 500)")
    p.add_argument("--layers", type=int, default=None, help="KV layers (4: a 4 MiB chunk)")
    p.add_argument("--l1-chunks", type=int, default=None, help="chunks L1 holds (64)")
    p.add_argument("--batch", type=int, default=None, help="prompts a lookup batch (16)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="tokens a lookup prompt (4,096)")
    add_output_args(p)
    p.set_defaults(func=run_events)


def run_events(ns: argparse.Namespace) -> int:
    resolve(
        ns,
        samples=(200, 60, 10),
        burst=(2000, 500, 50),
        layers=(4, 4, 1),
        l1_chunks=(64, 64, 8),
        batch=(16, 16, 4),
        prompt_tokens=(4096, 4096, 512),
    )
    if min(ns.samples, ns.burst, ns.layers, ns.l1_chunks, ns.batch, ns.prompt_tokens) < 1:
        print("bench: every count must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    chunk = ns.layers * 2 * CS * HEADS * HEAD_DIM * 2
    l1_gb = repr(ns.l1_chunks * chunk / (1 << 30))
    l1 = ["--chunk-size", str(CS), "--l1-size-gb", l1_gb, "--log-level", "error"]
    pub = free_port()
    plain = launch(*l1)
    events = launch(*l1, "--kv-events-endpoint", f"tcp://*:{pub}", "--kv-events-topic", "kv@bench@" + MODEL)
    sub = _Subscriber(f"tcp://127.0.0.1:{pub}")
    out: dict[str, Any] = {"chunk_bytes": chunk, "params": vars_of(ns)}
    try:
        for s in (plain, events):
            wait_http(s)
            wait_arena_ready(s)
        out |= _latency(ns, plain, events)
        out["burst"] = _burst(ns, events, sub)
        out["lookup"] = _lookups(ns, events)
    finally:
        sub.stop()
        plain.stop()
        events.stop()
    finish(ns, "events", out, report.show("events"))
    return 0


def vars_of(ns: argparse.Namespace) -> dict[str, int]:
    keys = ("samples", "burst", "layers", "l1_chunks", "batch", "prompt_tokens")
    return {k: int(getattr(ns, k)) for k in keys}


def _worker(s: BenchServer, layers: int) -> WorkerAdapter:
    w = WorkerAdapter(s.endpoint, MODEL, transfer_mode="server_driven")
    caches = allocate_kv_caches(layers, CS // BS, BS, HEADS, HEAD_DIM, torch.bfloat16)
    for c in caches:
        c.normal_()
    w.register_kv_caches(caches)
    return w


def _latency(ns: argparse.Namespace, plain: BenchServer, events: BenchServer) -> dict[str, Any]:
    wp, we = _worker(plain, ns.layers), _worker(events, ns.layers)
    rng = np.random.default_rng(5)
    off: list[float] = []
    on: list[float] = []
    first: dict[str, float] = {}
    try:
        for i in range(ns.samples):
            pair = [(wp, off), (we, on)]
            for w, times in pair if i % 2 == 0 else pair[::-1]:
                p = rng.integers(0, 50_000, CS)
                t0 = time.perf_counter()
                if w.store_detail(p, BLOCKS).stored != 1:
                    raise RuntimeError("bench events: a STORE was not kept")
                times.append(time.perf_counter() - t0)
        first = {"off_ms": 1e3 * off[0], "on_ms": 1e3 * on[0]}
    finally:
        wp.close()
        we.close()
    med_off, med_on = statistics.median(off), statistics.median(on)
    return {
        "store_ms": {"off": 1e3 * med_off, "on": 1e3 * med_on},
        "store_ratio": med_on / med_off,
        "first_store": first,
    }


def _burst(ns: argparse.Namespace, s: BenchServer, sub: _Subscriber) -> dict[str, Any]:
    w = _worker(s, ns.layers)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 50_000, CS) for _ in range(ns.burst)]
    before = _event_counts(s)
    t0 = time.perf_counter()
    try:
        for p in prompts:
            w.store_detail(p, BLOCKS)
        took = time.perf_counter() - t0
        deadline = time.monotonic() + 60
        while _event_counts(s)["queued"] and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a real process, under a deadline
        drained = time.perf_counter() - t0
    finally:
        w.close()
    after = _event_counts(s)
    published = after["events"] - before["events"]
    received = sub.counts()
    return {
        "stores": ns.burst,
        "seconds": took,
        "stores_per_s": ns.burst / took,
        "events": published,
        "events_per_s": published / drained,
        "dropped": after["dropped"] - before["dropped"],
        "received_batches": received[0],
        "received_gaps": received[1],
    }


def _event_counts(s: BenchServer) -> dict[str, float]:
    text = s.get("/metrics").decode()
    out = {"events": 0.0, "dropped": 0.0, "queued": 0.0}
    for line in text.splitlines():
        if line.startswith("kvwarden_kv_events_total{"):
            out["events"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvwarden_kv_events_dropped_total "):
            out["dropped"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvwarden_kv_events_queued "):
            out["queued"] = float(line.rsplit(" ", 1)[1])
    return out


def _lookups(ns: argparse.Namespace, s: BenchServer) -> dict[str, Any]:
    w = _worker(s, ns.layers)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 50_000, ns.prompt_tokens) for _ in range(ns.batch)]
    try:
        for p in prompts[: ns.batch // 2]:  # half of them: their first chunk held
            w.store_detail(p[:CS], BLOCKS)
    finally:
        w.close()
    body = json.dumps({"requests": [{"model": MODEL, "token_ids": p.tolist()} for p in prompts]}).encode()
    times = []
    rounds = max(5, 200 // ns.batch)
    for _ in range(rounds):
        req = urllib.request.Request(
            s.url + "/v1/lookup", data=body, headers={"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        times.append(time.perf_counter() - t0)
    held = sum(1 for x in answer["results"] if x["cpu_tokens"])
    return {
        "batches": rounds,
        "batch_ms": 1e3 * statistics.median(times),
        "batches_per_s": 1 / statistics.median(times),
        "prompts_per_s": ns.batch / statistics.median(times),
        "prompts_held": held,
    }


_SUBSCRIBER = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.setsockopt(zmq.RCVHWM, 0)
s.connect(sys.argv[1]); print("ready", flush=True)
last, batches, gaps = None, 0, 0
poller = zmq.Poller(); poller.register(s, zmq.POLLIN); poller.register(sys.stdin, zmq.POLLIN)
while True:
    ready = dict(poller.poll())
    if s in ready:
        _, seq, _ = s.recv_multipart(); n = int.from_bytes(seq, "big")
        gaps += last is not None and n != last + 1; last = n; batches += 1
    elif sys.stdin.fileno() in ready or sys.stdin in ready:
        sys.stdin.readline(); print(batches, gaps, flush=True)
"""


class _Subscriber:
    """Reads every event message in a process of its own (not this one's GIL, which the
    STOREs measured here use), counting batches and sequence gaps."""

    def __init__(self, endpoint: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SUBSCRIBER, endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("bench events: the subscriber did not start")

    def counts(self) -> tuple[int, int]:
        """(batches received, sequence gaps) so far."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        batches, gaps = self.proc.stdout.readline().split()
        return int(batches), int(gaps)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
