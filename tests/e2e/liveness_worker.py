"""A worker process for the liveness end-to-end tests (`tests/e2e/test_liveness.py`).

    python tests/e2e/liveness_worker.py ENDPOINT --heartbeat 0.3 [--model m] [--mode server_driven]

It allocates a tiny KV cache in shared memory, registers it, then prints one JSON object per
line on stdout:

    {"event": "registered", "instance_id": ..., "pid": ..., "segments": [...]}
    {"event": "state", "registrations": n, "refreshes": n, "healthy": bool}    (at start and on every change)
    {"event": "store", "seed": s, "ok": bool}
    {"event": "retrieve", "seed": s, "tokens": n, "equal": bool}
    {"event": "closed"}

and reads commands on stdin, one a line: ``store SEED`` (writes a pattern derived from SEED
into blocks 0-3 and stores 64 tokens derived from SEED), ``retrieve SEED`` (zeroes blocks 8-11,
retrieves those tokens into them and compares with the pattern byte for byte), ``quit``.
Its own state is watched by polling every 50 ms; logs go to stderr.

``--serve-on-go ARGS...`` instead makes a standby server: it imports everything
``kvwarden serve`` needs, prints ``{"event": "standby"}``, waits for one line on stdin, then runs
``kvwarden serve ARGS...``, so a test can restart a server on the same port at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 16, 16, 2, 8
N_TOKENS = 64  # four blocks of 16: four chunks at the tests' chunk size of 16
SRC_BLOCKS = [0, 1, 2, 3]
DST_BLOCKS = [8, 9, 10, 11]

_out_lock = threading.Lock()  # one JSON object per line, even from the watcher thread


def emit(**fields: Any) -> None:
    with _out_lock:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()


def serve_on_go(args: list[str]) -> int:
    import app.server  # noqa: F401  (imported now so the start is fast)
    from app import cli
    from dataplane.server import runtime  # noqa: F401

    emit(event="standby", pid=os.getpid())
    if not sys.stdin.readline():
        return 0
    return cli.main(["serve", *args])


def run_worker(ns: argparse.Namespace) -> int:
    import torch

    from dataplane.client import WorkerAdapter, allocate_kv_caches
    from dataplane.memory.shm import SHM_DIR

    def pattern(seed: int) -> tuple[list[int], list[torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 50_000, (N_TOKENS,), generator=g).tolist()
        data = [
            torch.randn((2, len(SRC_BLOCKS), BLOCK_SIZE, HEADS, HEAD_DIM), generator=g).to(torch.bfloat16)
            for _ in range(LAYERS)
        ]
        return tokens, data

    before = {p.name for p in SHM_DIR.iterdir()}
    caches = allocate_kv_caches(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, torch.bfloat16)
    mine = f"kvwarden-{os.getpid()}-"
    segments = sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(mine) and p.name not in before)
    w = WorkerAdapter(
        ns.endpoint,
        model_name=ns.model,
        heartbeat_interval=ns.heartbeat,
        transfer_mode=ns.mode,
        request_timeout=ns.request_timeout,
    )
    w.register_kv_caches(caches)
    emit(event="registered", instance_id=w.instance_id, pid=os.getpid(), segments=segments)

    stop = threading.Event()

    def watch() -> None:
        last: tuple[int, int, bool] | None = None
        while True:
            now = (w.registrations, w.refreshes, w.is_healthy)
            if now != last:
                emit(event="state", registrations=now[0], refreshes=now[1], healthy=now[2])
                last = now
            if stop.wait(0.05):
                return

    watcher = threading.Thread(target=watch, name="liveness-watch", daemon=True)
    watcher.start()
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        seed = int(cmd[1]) if len(cmd) > 1 else 0
        tokens, data = pattern(seed)
        if cmd[0] == "store":
            for layer, d in zip(caches, data, strict=True):
                layer[:, SRC_BLOCKS] = d
            emit(event="store", seed=seed, ok=bool(w.store(tokens, SRC_BLOCKS)))
        elif cmd[0] == "retrieve":
            for layer in caches:
                layer[:, DST_BLOCKS] = 0
            n = w.retrieve(tokens, DST_BLOCKS)
            equal = all(
                torch.equal(layer[:, DST_BLOCKS].view(torch.int16), d.view(torch.int16))
                for layer, d in zip(caches, data, strict=True)
            )
            emit(event="retrieve", seed=seed, tokens=n, equal=equal)
        else:
            emit(event="error", message=f"unknown command {cmd[0]!r}")
    stop.set()
    watcher.join(5)
    w.close()
    emit(event="closed")
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-on-go":
        return serve_on_go(sys.argv[2:])
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("--heartbeat", type=float, default=0.3)
    p.add_argument("--model", default="liveness")
    p.add_argument("--mode", default="server_driven", choices=["server_driven", "engine_driven"])
    p.add_argument("--request-timeout", type=float, default=10.0)
    ns = p.parse_args()
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run_worker(ns)


if __name__ == "__main__":
    sys.exit(main())
