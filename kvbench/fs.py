"""`kvwarden bench fs`: the file tier, beside plain reads of the same files in this process.

The files go to a temporary directory under ``--dir`` (default: the current one; removed at the
end), on the file system the report names. Every server is fresh (no warm-up); a prompt is one
32 MiB chunk of 256 tokens (Llama-3-8B's KV shape).

- **STORE, file tier on vs off**: server A (``--fs-path``) and server P (none) STORE distinct
  one-chunk prompts, in turn: the latency ratio A / P. A's earlier chunks may still be being
  written meanwhile, as in service.
- **RETRIEVE from disk**: once A has written every chunk it is stopped; a fresh server B on the
  same directory (its L1 cold) RETRIEVEs each prompt, and this process reads the same file
  (``readinto`` a buffer allocated beforehand). *Fresh*: the file dropped from the page cache
  (``posix_fadvise(DONTNEED)``) right before each read, the server's and ours, with an
  ``O_DIRECT`` read beside them where the file system takes it. *Warm*: the file read once
  first, and beside the two the tier's own checked copy of it run in this process
  (`resident.read_resident` into the worker's blocks, on one thread, with no request around
  it): with one chunk a request, the floor under a warm RETRIEVE. Ratio: the plain read's
  time / RETRIEVE's (1.0: as fast as reading the file).
- **Restart**: a directory of many small chunk files (written here in the tier's layout and
  format, their keys as a server computes them for the worker that then asks) and an empty
  one, servers started in turn: start to the first PING answered, to the first RETRIEVE
  answered (from disk: a hit), and how long the index took to be rebuilt. The directories'
  entries are in the kernel's caches (the files were written just before).
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.memory.copies import ChunkMap
from dataplane.memory.kvmemory import MappedKV
from dataplane.storage.compress import NONE
from dataplane.storage.fs import chunk_file, resident
from dataplane.storage.fs.layout import chunk_path
from dataplane.storage.keys import chunk_keys, scope_digest
from dataplane.wire.messages import MemoryKind
from kvbench import report
from kvbench.fs_restart import BS, CS, drop_cached, poll_fs, restart
from kvbench.procs import BenchServer, launch, wait_arena_ready, wait_http
from kvbench.results import add_output_args, finish, resolve

MODEL, HEADS, HEAD_DIM = "bench", 8, 128  # Llama-3-8B's KV heads
ALIGN = 4096  # O_DIRECT: buffer, offsets and lengths in whole blocks


def add_args(sub: Any) -> None:
    p = sub.add_parser(
        "fs", help="the file tier: RETRIEVE from disk vs plain reads, STORE with vs without it, restart"
    )
    p.add_argument("--samples", type=int, default=None, help="prompts per condition (9; quick 5)")
    p.add_argument("--layers", type=int, default=None, help="KV layers (32: a 32 MiB chunk)")
    p.add_argument("--files", type=int, default=None, help="chunk files at restart (100,000; quick 20,000)")
    p.add_argument("--rounds", type=int, default=None, help="server starts per directory (3; quick 1)")
    p.add_argument(
        "--chunks-per-request",
        type=int,
        default=1,
        help="chunks a prompt has (1): a STORE and a RETRIEVE move them all; the plain reads read each file",
    )
    p.add_argument("--dir", type=Path, default=None, help="where the files go (default: here); not a tmpfs")
    p.add_argument(
        "--fs-compression",
        choices=("none", "lossless"),
        default="none",
        help="the servers' fs_compression: lossless codes the chunks (random bfloat16: about 1.5x)",
    )
    add_output_args(p)
    p.set_defaults(func=run_fs)


def run_fs(ns: argparse.Namespace) -> int:
    resolve(ns, samples=(9, 5, 2), layers=(32, 32, 2), files=(100_000, 20_000, 500), rounds=(3, 1, 1))
    if min(ns.samples, ns.layers, ns.files, ns.rounds, ns.chunks_per_request) < 1:
        print(
            "bench: --samples, --layers, --files, --rounds and --chunks-per-request must be at least 1",
            file=sys.stderr,
        )
        return 2
    parent = Path.cwd() if ns.dir is None else ns.dir
    if not parent.is_dir():
        print(f"bench: --dir {str(parent)!r} is not a directory", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix=".kvbench-fs-", dir=parent))
    where = filesystem(root)
    memory = " (memory, not a disk: the figures are the page cache's)" if where["type"] == "tmpfs" else ""
    print(f"bench fs: files under {root}: {where['type']} on {where['device']}{memory}", flush=True)
    params = {"samples": ns.samples, "layers": ns.layers, "chunk_tokens": CS, "rounds": ns.rounds}
    params["chunks_per_request"] = ns.chunks_per_request
    params["fs_compression"] = ns.fs_compression
    try:
        out: dict[str, Any] = {"params": params, "filesystem": where}
        out |= _tier(ns, root / "tier", where["type"])
        out["restart"] = restart(ns, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    finish(ns, "fs", out, report.show("fs"))
    return 0


def filesystem(path: Path) -> dict[str, str]:
    """The mount ``path`` lies on (/proc/mounts' longest match): its type, device and mount point."""
    real = os.path.realpath(path)
    best = {"type": "unknown", "device": "unknown", "mount": ""}
    for line in Path("/proc/mounts").read_text().splitlines():
        dev, mnt, kind = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), f) for f in line.split()[:3])
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best["mount"]):
            best = {"type": kind, "device": dev, "mount": mnt}
    return best


def _tier(ns: argparse.Namespace, d: Path, kind: str) -> dict[str, Any]:
    d.mkdir()
    chunk = ns.layers * 2 * CS * HEADS * HEAD_DIM * 2
    n = ns.chunks_per_request
    # L1 holds every STORE of A while the writer lags (its chunks are pinned until written)
    l1_gb = "0.25" if ns.tiny else str(max(2, 1 + (2 * ns.samples * n * chunk >> 30)))
    common = ["--chunk-size", str(CS), "--l1-size-gb", l1_gb, "--log-level", "error"]
    cap = ["--fs-size-gb", str(1 + (3 * ns.samples * n * chunk >> 30)), "--fs-write-queue-mb", str(2048 * n)]
    with_fs = [*common, "--fs-path", str(d), *cap, "--fs-compression", ns.fs_compression]
    samples: dict[str, list[float]] = {}
    plain, a = launch(*common), launch(*with_fs)
    try:
        prompts, cache = _stores(ns, plain, a, samples)
        poll_fs(a, lambda f: f["puts"] >= len(prompts) and f["queue_depth"] == 0, "the chunks written")
    finally:
        plain.stop()
        a.stop()
    scope = scope_digest(MODEL, 1, 0, "bfloat16", ns.layers, HEADS, HEAD_DIM)
    keys = [chunk_keys(scope, p, CS) for p in prompts]
    paths = [[chunk_path(str(d), scope, k) for k in ks] for ks in keys]
    for path in (p for ps in paths for p in ps):
        drop_cached(path)  # (written back first: a dirty page stays in the cache)
    b = launch(*with_fs)
    try:
        files = [(p, list(zip(ps, ks, strict=True))) for p, ps, ks in zip(prompts, paths, keys, strict=True)]
        why, status = _reads(ns, b, kind, files, cache, samples)
    finally:
        b.stop()
    s = {k: [1e3 * x for x in v] for k, v in samples.items()}
    m = {k: statistics.median(v) for k, v in s.items() if v}
    by: dict[str, dict[str, float | None]] = {
        c: {k.split("_", 1)[1]: v for k, v in m.items() if k.startswith(c)} for c in ("fresh", "warm")
    }
    direct = by["fresh"].setdefault("direct_read", None)
    return {
        "chunk_bytes": chunk,
        "file_bytes": os.path.getsize(paths[0][0]),
        "store_ms": {"without_fs": m["store_without_fs"], "with_fs": m["store_with_fs"]},
        "store_ratio": m["store_with_fs"] / m["store_without_fs"],
        "fresh_ms": by["fresh"],
        "warm_ms": by["warm"],
        "ratios": {
            "fresh": m["fresh_buffered_read"] / m["fresh_retrieve"],
            "warm": m["warm_buffered_read"] / m["warm_retrieve"],
            "warm_floor": m["warm_buffered_read"] / m["warm_checked_copy"],
            "direct": None if direct is None else direct / m["fresh_retrieve"],
        },
        "direct_io": why,
        "server_fs": status,
        "samples_ms": s,
    }


def _worker(
    server: BenchServer, layers: int, fill: bool, chunks: int = 1
) -> tuple[WorkerAdapter, list[torch.Tensor]]:
    """A worker of ``server`` once its L1 arena is faulted in, with the blocks of a prompt of
    ``chunks`` chunks; its cache random when ``fill``."""
    wait_http(server)
    wait_arena_ready(server)
    caches = allocate_kv_caches(layers, chunks * CS // BS, BS, HEADS, HEAD_DIM, torch.bfloat16)
    for c in caches if fill else ():
        c.copy_(torch.randn(c.shape).to(torch.bfloat16))
    w = WorkerAdapter(server.endpoint, MODEL, heartbeat_interval=5.0)
    w.register_kv_caches(caches)
    return w, caches


def _stores(
    ns: argparse.Namespace, plain: BenchServer, a: BenchServer, samples: dict[str, list[float]]
) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """2 x samples distinct STOREs (of --chunks-per-request chunks) through each of P and A, in
    turn (who goes first alternates); A's prompts and its worker's cache (what B must give back)."""
    torch.set_num_threads(1)
    n = ns.chunks_per_request
    wp, _ = _worker(plain, ns.layers, True, n)
    wa, cache = _worker(a, ns.layers, True, n)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 50_000, n * CS) for _ in range(4 * ns.samples)]
    off, on = samples.setdefault("store_without_fs", []), samples.setdefault("store_with_fs", [])
    try:
        for i in range(2 * ns.samples):
            pair = [(wp, off, prompts[2 * i]), (wa, on, prompts[2 * i + 1])]
            for w, times, p in pair if i % 2 == 0 else pair[::-1]:
                t0 = time.perf_counter()
                if w.store_detail(p, np.arange(n * CS // BS)).stored != n:
                    raise RuntimeError("bench fs: a STORE was not kept")
                times.append(time.perf_counter() - t0)
    finally:
        wp.close()
        wa.close()
    return prompts[1::2], cache


def _read(paths: list[str], buf: memoryview) -> int:
    """The baseline: each file read whole with buffered ``readinto`` into ``buf`` (its size;
    page aligned, as L1's buffers are: a bytearray, 16 bytes past a page, reads 3-4x slower)."""
    n = 0
    for path in paths:
        with open(path, "rb") as f:
            n += f.readinto(buf)  # (a buffered reader fills it whole, up to the end of the file)
    return n


class _Direct:
    """Whole files read with ``O_DIRECT`` (past the page cache) into one page-aligned buffer."""

    def __init__(self, size: int) -> None:
        self.mem = mmap.mmap(-1, -(-size // ALIGN) * ALIGN)
        self.view = memoryview(self.mem)

    def read(self, paths: list[str]) -> int:
        n = 0
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                n += os.preadv(fd, [self.view], 0)  # (whole, up to the end of the file: one call)
            finally:
                os.close(fd)
        return n


def _direct(path: str, size: int, kind: str) -> tuple[_Direct | None, str]:
    """An O_DIRECT reader, tried once on ``path``; None and why where the file system refuses
    (or, in memory, takes the flag with no disk beneath to read past the cache to)."""
    if kind in ("tmpfs", "ramfs"):
        return None, f"not supported on this file system ({kind}: no disk beneath the page cache)"
    reader = _Direct(size)
    try:
        ok = reader.read([path]) == size
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None, f"not supported on this file system ({exc.strerror})"
    return (reader, "supported") if ok else (None, "not supported: a short read")


def _retrieve(w: WorkerAdapter, prompt: np.ndarray) -> None:
    if (got := w.retrieve(prompt, np.arange(len(prompt) // BS))) != len(prompt):
        raise RuntimeError(f"bench fs: a RETRIEVE from disk missed ({got} tokens)")


def _chunk_views(caches: list[torch.Tensor], chunks: int) -> list[list[memoryview]]:
    """Each chunk's bytes in the worker's blocks (blocks 0, 1, ...: a prompt's), as the server
    maps them for a read in place (`MappedKV.chunk_views` of the chunk's `ChunkMap` entry)."""
    nb = caches[0].shape[1]
    layers = [c.view(2, nb * BS, HEADS * HEAD_DIM) for c in caches]
    kv = MappedKV(MemoryKind.SHM, caches[0].dtype, len(layers), nb, BS, HEADS, HEAD_DIM, layers, None)
    where = ChunkMap(np.arange(nb), BS, nb, chunks, CS)
    views = [kv.chunk_views(where[j]) for j in range(chunks)]
    if any(v is None for v in views):
        raise RuntimeError("bench fs: the worker's blocks do not map for a read in place")
    return [v for v in views if v is not None]


def _checked(files: list[tuple[str, bytes]], views: list[list[memoryview]], staging: memoryview) -> None:
    """The tier's own checked read of each (warm) file into its chunk's views, as a RETRIEVE
    does it without the request around it: in place (`resident.read_resident`), or where the
    file system refuses reads in place (a tmpfs), staged (`chunk_file.read_chunk` into
    ``staging``, then copied on into the views)."""
    for (path, key), v in zip(files, views, strict=True):
        nbytes = sum(x.nbytes for x in v)
        f = chunk_file.open_chunk(path, key, nbytes)
        if f is None:
            raise RuntimeError(f"bench fs: {path} is gone")
        try:
            if f.header.codec != NONE:  # a coded file: read whole, checked, decoded (as the tier does)
                raise resident.InPlaceRefused
            placed = resident.read_resident(f, v)
        except resident.InPlaceRefused:
            placed = chunk_file.read_chunk(path, key, nbytes, lambda n: staging[:n]) is not None
            at = 0
            for x in v:
                x[:] = staging[at : at + x.nbytes]
                at += x.nbytes
        finally:
            os.close(f.fd)
        if not placed:
            raise RuntimeError(f"bench fs: {path} left the page cache before its checked copy")


def _reads(
    ns: argparse.Namespace,
    b: BenchServer,
    kind: str,
    files: list[tuple[np.ndarray, list[tuple[str, bytes]]]],
    stored: list[torch.Tensor],
    samples: dict[str, list[float]],
) -> tuple[str, dict[str, Any]]:
    """B's RETRIEVEs of A's prompts beside this process's reads of their files: the first
    samples fresh (each file dropped from the page cache before each read), the rest warm; the
    readers' order rotates from one prompt to the next. Whether O_DIRECT worked; B's counters."""
    w, cache = _worker(b, ns.layers, False, ns.chunks_per_request)
    poll_fs(b, lambda f: bool(f["rebuilt"]), "rebuilt")  # (the scan of a few files: not beside the reads)
    first = files[0][1][0][0]
    size = max(os.path.getsize(first), ns.layers * 2 * CS * HEADS * HEAD_DIM * 2)  # (a coded file is smaller)
    buf = memoryview(mmap.mmap(-1, size))
    direct, why = _direct(first, size, kind)
    views = _chunk_views(cache, ns.chunks_per_request)
    samples.update({f"{c}_{k}": [] for c in ("fresh", "warm") for k in ("retrieve", "buffered_read")})
    samples["fresh_direct_read"], samples["warm_checked_copy"] = [], []
    try:
        for i, (prompt, chunk_files) in enumerate(files):
            when = "fresh" if i < ns.samples else "warm"
            paths = [path for path, _ in chunk_files]
            steps: list[tuple[str, Callable[[], object]]] = [
                (f"{when}_retrieve", partial(_retrieve, w, prompt)),
                (f"{when}_buffered_read", partial(_read, paths, buf)),
            ]
            if when == "fresh" and direct is not None:
                steps.append(("fresh_direct_read", partial(direct.read, paths)))
            if when == "warm":
                steps.append(("warm_checked_copy", partial(_checked, chunk_files, views, buf)))
                _read(paths, buf)  # the page cache hot
            turn = i % len(steps)
            for name, fn in steps[turn:] + steps[:turn]:
                for path in paths if when == "fresh" else ():
                    drop_cached(path)
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
                if name.endswith("_retrieve"):  # (what it read in place reaches L1: not beside the next)
                    poll_fs(b, lambda f: f["promoted"] >= f["read_in_place"], "promoted")
            if i == 0 and not all(torch.equal(x, y) for x, y in zip(stored, cache, strict=True)):
                raise RuntimeError("bench fs: a RETRIEVE from disk gave back other bytes than were stored")
        f = b.json("/status")["storage"]["fs"]
    finally:
        w.close()
    return why, {k: f[k] for k in ("files", "hits", "misses", "read_ahead", "read_in_place", "promoted")}
