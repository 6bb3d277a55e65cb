"""The samplers of `kvwarden bench transfer`: each call takes one sample, in bytes per second.

`Mover` is the worker side of one configuration (its KV caches and an adapter registered in
one transfer mode): full-stack STORE and RETRIEVE, timed as the caller sees them. `Baselines`
are what the same bytes cost otherwise: single-thread memcpy of one chunk, sending it over a
ZMQ socket, Redis SET and GET of it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq

from dataplane.client import WorkerAdapter, allocate_kv_caches, free_kv_caches
from dataplane.memory.copies import ChunkMap, CopySplitter, server_copy_ways
from dataplane.memory.kvmemory import TORCH_DTYPES, map_local_tensors
from kvbench.procs import free_port

# An engine-driven worker of the benchmark copies on threads of its own (`copy_threads`), torch's
# intra-op threads at 1 in this process (as in the server): toggling torch's thread count around
# each memcpy sample cost the next engine-driven copy ~1.4 ms, its OpenMP team rebuilt
COPY_THREADS = 2


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return float(time.perf_counter() - t0)


@dataclass(frozen=True)
class Shape:
    """What one request moves: chunk tokens and bytes, chunks, tokens and blocks."""

    chunk_tokens: int
    chunk_bytes: int
    chunks_per_request: int
    tokens: int
    blocks: int  # blocks one request's tokens fill

    @classmethod
    def of(cls, ns: argparse.Namespace, chunk_tokens: int, cpr: int) -> Shape:
        item = torch.empty((), dtype=TORCH_DTYPES[ns.dtype]).element_size()
        chunk_bytes = ns.layers * 2 * chunk_tokens * ns.heads * ns.head_dim * item
        tokens = cpr * chunk_tokens
        return cls(chunk_tokens, chunk_bytes, cpr, tokens, tokens // ns.block_size)

    @property
    def request_bytes(self) -> int:
        return self.chunks_per_request * self.chunk_bytes


class Mover:
    """A worker of one transfer mode: half its blocks are stored from, half receive. Its KV
    caches are allocated and written first; `register` connects it to a server."""

    def __init__(self, ns: argparse.Namespace, shape: Shape, mode: str) -> None:
        self.shape, self.mode = shape, mode
        self.rng = np.random.default_rng(0)
        dtype, nb = TORCH_DTYPES[ns.dtype], 2 * shape.blocks
        geometry = (ns.layers, nb, ns.block_size, ns.heads, ns.head_dim)
        self.kv_format = getattr(ns, "kv_format", "token_major")
        if self.kv_format == "vllm_cpu":  # vLLM's CPU blocks: [blocks, heads, block size, K and V]
            full = torch.empty((ns.layers, nb, ns.heads, ns.block_size, 2 * ns.head_dim), dtype=dtype)
            self.caches = list(full.unbind(0))
        elif mode == "engine_driven":  # the engine's own tensors: the server cannot map them
            full = torch.empty((ns.layers, 2, *geometry[1:]), dtype=dtype, device=ns.device)
            self.caches = list(full.unbind(0))
        else:
            self.caches = allocate_kv_caches(*geometry, dtype, ns.device)
        for c in self.caches:
            c.view(torch.uint8).random_()
        self.w: WorkerAdapter | None = None
        self.register_s = 0.0

    def register(self, endpoint: str) -> None:
        w = WorkerAdapter(
            endpoint,
            "bench",
            heartbeat_interval=5.0,
            request_timeout=300,
            transfer_mode=self.mode,
            pool_chunks=max(4, self.shape.chunks_per_request),
            copy_threads=COPY_THREADS if self.mode == "engine_driven" else None,
        )
        self.w = w
        t0 = time.perf_counter()
        w.register_kv_caches(self.caches, self.kv_format)
        self.register_s = time.perf_counter() - t0

    @property
    def adapter(self) -> WorkerAdapter:
        if self.w is None:
            raise RuntimeError("register() first")
        return self.w

    def prompt(self) -> np.ndarray:
        """Token ids of a prompt never stored before."""
        return self.rng.integers(0, 1 << 30, self.shape.tokens)

    def store(self, tokens: np.ndarray) -> float:
        blocks = self.rng.permutation(self.shape.blocks)
        t0 = time.perf_counter()
        r = self.adapter.store_detail(tokens, blocks)
        took = time.perf_counter() - t0
        if r.rejected or r.stored + r.present != self.shape.chunks_per_request:
            raise RuntimeError(f"STORE did not keep every chunk: {r}")
        return self.shape.request_bytes / took

    def retrieve(self, tokens: np.ndarray) -> float:
        blocks = self.shape.blocks + self.rng.permutation(self.shape.blocks)
        t0 = time.perf_counter()
        got = self.adapter.retrieve(tokens, blocks)
        took = time.perf_counter() - t0
        if got != self.shape.tokens:
            raise RuntimeError(f"RETRIEVE got {got} of {self.shape.tokens} tokens")
        return self.shape.request_bytes / took

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
        else:  # never registered: its segment is still ours to unlink
            free_kv_caches(self.caches)


# the copy floor's destination buffers rotate over at least this many bytes, several times a
# server CPU's L3 cache: each copy writes memory the last ones did not, as STOREs write L1
_FLOOR_BYTES = 256 << 20


class CopyFloor:
    """The copy a request makes, made here without a server or a request: the request's blocks
    gathered out of (scattered back into) the worker's caches, chunk by chunk, on as many threads
    as the server copies with (`server_copy_ways`), into buffers that rotate. This machine's own
    limit for that copy: random blocks of a paged cache, not one contiguous run as memcpy copies.
    STORE / gather and RETRIEVE / scatter show what the request itself costs. CPU caches only."""

    def __init__(self, mover: Mover) -> None:
        self.shape = mover.shape
        self.local = map_local_tensors(mover.caches)
        self.rng = np.random.default_rng(1)  # not the mover's: its prompts stay the same
        self.splitter = CopySplitter(server_copy_ways())
        self.splitter.start()
        n = max(2, _FLOOR_BYTES // self.shape.request_bytes)
        self.bufs = [torch.zeros(self.shape.request_bytes, dtype=torch.uint8) for _ in range(n)]
        self.turn = 0

    def _timed_copy(self, first_block: int, to_chunks: bool) -> float:
        sh, local = self.shape, self.local
        blocks = first_block + self.rng.permutation(sh.blocks)
        chunks = ChunkMap(blocks, local.block_size, local.num_blocks, sh.chunks_per_request, sh.chunk_tokens)
        buf = self.bufs[self.turn % len(self.bufs)]
        self.turn += 1
        move = local.gather if to_chunks else local.scatter
        cb = sh.chunk_bytes
        t0 = time.perf_counter()
        for c in range(sh.chunks_per_request):
            move(chunks[c], buf[c * cb : (c + 1) * cb], self.splitter)
        return sh.request_bytes / (time.perf_counter() - t0)

    def gather(self) -> float:
        """As a STORE copies: from the blocks the mover stores from."""
        return self._timed_copy(0, True)

    def scatter(self) -> float:
        """As a RETRIEVE copies: into the blocks the mover retrieves into."""
        return self._timed_copy(self.shape.blocks, False)

    def close(self) -> None:
        self.splitter.stop()
        self.bufs = []


class _ZmqSink:
    """A ROUTER thread that acknowledges every frame: the naive data plane."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-zmq-sink")
        self.thread.start()

    def _run(self) -> None:
        while True:
            ident, data = self.sock.recv_multipart(copy=False)
            if len(data) == 0:
                self.sock.send_multipart([ident, b"bye"])
                self.sock.close(linger=0)
                return
            self.sock.send_multipart([ident, b"ok"])


def start_redis(own_session: bool = False) -> tuple[subprocess.Popen[bytes], Any] | None:
    """A throwaway ``redis-server`` on a free port (no persistence) and a client; None when
    ``redis-server`` is not installed. ``own_session``: as `kvbench.procs.launch`'s."""
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    import redis

    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [exe, *args, "--proto-max-bulk-len", "2gb"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=own_session,
    )
    r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
    deadline = time.monotonic() + 10
    pause = threading.Event()
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            r.ping()
            return proc, r
        except redis.ConnectionError:
            pause.wait(0.02)
    proc.kill()
    proc.wait()
    return None


class Baselines:
    """memcpy, ZMQ and Redis samplers for chunks of ``n`` bytes (`resize` changes ``n``)."""

    def __init__(self, redis_pair: tuple[subprocess.Popen[bytes], Any] | None) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sink = _ZmqSink(self.ctx)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.connect(self.sink.endpoint)
        self.redis_pair = redis_pair
        self.n = 0
        self.src = self.dst = torch.empty(0, dtype=torch.uint8)
        self.blob = b""

    def resize(self, n: int) -> None:
        """Buffers of ``n`` bytes, written once (no page faults left for the samples)."""
        if n != self.n:
            self.n = n
            self.src = torch.empty(n, dtype=torch.uint8).random_()
            self.dst = torch.zeros(n, dtype=torch.uint8)
            self.blob = self.src.numpy().tobytes()
            self.memcpy()

    def memcpy(self) -> float:
        """One thread: `kvwarden bench transfer` runs with torch's intra-op threads at 1."""
        return self.n / _timed(lambda: self.dst.copy_(self.src))

    def zmq(self) -> float:
        return self.n / _timed(lambda: (self.dealer.send(self.blob, copy=False), self.dealer.recv()))

    def others(self) -> dict[str, Callable[[], float]]:
        """The samplers besides memcpy: ZMQ, and Redis SET / GET when Redis runs."""
        out: dict[str, Callable[[], float]] = {"zmq": self.zmq}
        if self.redis_pair is not None:
            r = self.redis_pair[1]
            out["redis_set"] = lambda: self.n / _timed(lambda: r.set("bench", self.blob))
            out["redis_get"] = lambda: self.n / _timed(lambda: r.get("bench"))
        return out

    def close(self) -> None:
        self.dealer.send(b"")  # the sink answers and its thread ends
        self.dealer.recv()
        self.sink.thread.join(5)
        self.dealer.close(linger=0)
        self.ctx.destroy(linger=0)
        if self.redis_pair is not None:
            self.redis_pair[1].close()
            self.redis_pair[0].kill()
            self.redis_pair[0].wait()
