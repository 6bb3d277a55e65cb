"""`kvwarden bench fs`, its restart part: servers started on a directory of many small chunk
files and on an empty one, in turn; and the helpers the file tier's figures share (`kvbench.fs`)."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.storage.fs.chunk_file import file_header
from dataplane.storage.fs.layout import chunk_path
from dataplane.storage.keys import chunk_keys, scope_digest
from kvbench.procs import BenchServer, launch_pinged, wait_http

BS, CS = 16, 256
BLOCKS = np.arange(CS // BS)
SMALL_MODEL, SMALL_HEAD_DIM = "bench-restart", 2  # restart files: 1 layer, 1 head: 2 KiB chunks


def poll_fs(server: BenchServer, ready: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    """Poll `/status` (300 s at most) until the file tier's view is ``ready``; that view."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        f: dict[str, Any] = server.json("/status")["storage"]["fs"]
        if f["dropped_writes"] or f["put_failures"]:
            raise RuntimeError(f"bench fs: writes lost: {f}")
        if ready(f):
            return f
        time.sleep(0.02)  # polling a real process, under a deadline
    raise RuntimeError(f"bench fs: not {what} within 300 s")


def drop_cached(path: str) -> None:
    """Write ``path`` back (if dirty) and drop it from the page cache (no root needed)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def restart(ns: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Servers started on a directory of ``ns.files`` chunk files and on an empty one, in turn."""
    (root / "empty").mkdir()
    t0 = time.perf_counter()
    probes = _fill(str(root / "many"), ns.files, ns.rounds)
    fill_s = time.perf_counter() - t0
    l1_gb = "0.0625" if ns.tiny else "1"
    runs: dict[str, list[dict[str, Any]]] = {"empty": [], "many": []}
    for r in range(ns.rounds):
        order = [("empty", None), ("many", probes[r])]
        for name, prompt in order if r % 2 == 0 else order[::-1]:
            runs[name].append(_start(root / name, prompt, l1_gb))
    if any(run["files"] != ns.files for run in runs["many"]):
        raise RuntimeError(f"bench fs: the index did not find the {ns.files} files: {runs['many']}")
    out: dict[str, Any] = {"files": ns.files, "fill_s": fill_s, "l1_size_gb": float(l1_gb)}
    for name, rs in runs.items():
        out[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "files"}
        out[name] |= {"files": rs[-1]["files"], "runs": rs}
    out["ping_ratio"] = out["many"]["first_ping_s"] / out["empty"]["first_ping_s"]
    out["ping_delta_ms"] = 1e3 * (out["many"]["first_ping_s"] - out["empty"]["first_ping_s"])
    return out


def _fill(d: str, n: int, n_probes: int) -> list[np.ndarray]:
    """``n`` one-chunk files under ``d``, as a server would write them for a worker of the small
    shape; the prompts of ``n_probes`` of them (spread out), dropped from the page cache."""
    scope = scope_digest(SMALL_MODEL, 1, 0, "bfloat16", 1, 1, SMALL_HEAD_DIM)
    payload = os.urandom(2 * CS * SMALL_HEAD_DIM * 2)
    base = np.random.default_rng(11).integers(0, 50_000, CS)
    os.mkdir(d)
    made: set[str] = set()
    probes: list[tuple[np.ndarray, str]] = []
    step = max(1, n // n_probes)
    for i in range(n):
        tokens = base.copy()
        tokens[0] = 50_000 + i
        key = chunk_keys(scope, tokens, CS)[0]
        path = chunk_path(d, scope, key)
        folder = os.path.dirname(path)
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, file_header(key, memoryview(payload)) + payload)
        finally:
            os.close(fd)
        if i % step == 0 and len(probes) < n_probes:
            probes.append((tokens, path))
    os.sync()  # (the writeback is not left to run beside the starts)
    for _, path in probes:
        drop_cached(path)
    return [tokens for tokens, _ in probes]


def _start(d: Path, prompt: np.ndarray | None, l1_gb: str) -> dict[str, Any]:
    """A server started on ``d``: from the start to its first PING answered (queued before), the
    first RETRIEVE answered (``prompt``'s file is in ``d``; None: a miss) and the index rebuilt."""
    caches = allocate_kv_caches(1, CS // BS, BS, 1, SMALL_HEAD_DIM, torch.bfloat16)
    fs = ("--fs-path", str(d), "--fs-size-gb", "4")
    server, ping = launch_pinged("--chunk-size", str(CS), "--l1-size-gb", l1_gb, "--log-level", "error", *fs)
    w: WorkerAdapter | None = None
    try:
        w = WorkerAdapter(server.endpoint, SMALL_MODEL, heartbeat_interval=5.0)
        w.register_kv_caches(caches)
        registered = time.perf_counter() - server.started
        got = w.retrieve(np.arange(CS) if prompt is None else prompt, BLOCKS)
        retrieved = time.perf_counter() - server.started
        if prompt is not None and got != CS:
            raise RuntimeError(f"bench fs: the first RETRIEVE after a restart missed its file ({got} tokens)")
        wait_http(server)
        f = poll_fs(server, lambda f: bool(f["rebuilt"]), "rebuilt")
        return {
            "first_ping_s": ping,
            "registered_s": registered,  # the REGISTER is held until the server is open
            "first_retrieve_s": retrieved,
            "rebuilt_s": time.perf_counter() - server.started,  # when /status first said so
            "rebuild_seconds": f["rebuild_seconds"],  # the tier's own figure
            "files": f["files"],
        }
    finally:
        if w is not None:
            w.close()
        server.stop()
