"""Processes of the reliability tests: KV workers whose bytes any reader can check, a
`kvwarden serve` wrapper, and the test-side handles that drive them.

Workers (`Proc`) are real processes forked from a fork server (``multiprocessing``'s
``forkserver``) that imported torch, zmq and the client once, so a test can start or replace
one in milliseconds instead of a second of CPU. Each registers a `WorkerAdapter` over a
shared-memory cache of this module's layout (plain tensors when engine-driven) in the test's
segment directory, sends events over a pipe, the first ``{"ev": "registered", "instance_id",
"pid", "segments"}``, and plays one role:

    writer   stores random prompts of the prompt set (``prompts_seed``) in a loop, each at random
             blocks: ``store_begin`` / ``store_end`` (with STORE's counts) around every store;
             stops on any message (``stop``): closes its adapter, sends ``closed``, exits 0
    reader   retrieves random prompts in a loop into random blocks filled with a sentinel and
             checks every byte (``retrieve_begin`` / ``retrieve_end`` with ``n`` and ``bad``)
    agent    one command a message (``{"op": "store", "prompt": i}``, ``retrieve``, ``check_all``:
             retrieve every prompt, ``state``), one reply each (``stored``, ``retrieved``,
             ``checked``, ``state_now``); ``stop`` closes it; a watcher thread sends ``state``
             whenever (registrations, refreshes, healthy) changes

``python -m tests.reliability.workers serve --parent PID [--nofile-soft N] [--nofile-hard N]
[--standby] -- ARGS`` sets RLIMIT_NOFILE, asks for SIGTERM when the test process dies, and
execs ``python -m app.cli serve ARGS`` (`Serve`); with ``--standby`` it imports the server,
prints ``standby``, waits for a line on stdin, then serves in this process, so a restart on
the same ports takes a fraction of a second.

KV bytes are a pure function of the prompt (`kv_for`): token ``i`` of a prompt gets bytes
derived from its id, its position and a digest of every token up to the end of its chunk (as
a real model's KV depends on the prefix), so a reader verifies every byte it gets back without
having seen the writer, and a chunk served under the wrong key or at the wrong place shows.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import http.client
import logging
import multiprocessing as mp
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.procs import free_port
from tests.helpers import ROOT, ServerProcess, subprocess_env, wait_until

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 64, 16, 8, 64  # 8 KiB of KV per token
CHUNK = 32  # the servers' --chunk-size: 256 KiB per chunk
N_PROMPTS = 24
SENTINEL = 0x1357  # what a reader's blocks hold before a retrieve (as int16)
Event = dict[str, Any]


# ------------------------------------------------------------------------ the prompt set


def prompt_set(seed: int, n: int = N_PROMPTS) -> list[list[int]]:
    """``n`` prompts of 2 to 10 full chunks plus a partial one; prompts of one family (six
    families) share a prefix of 1 to 5 chunks, so writers race on the same chunks."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, 50_000, 10 * CHUNK).tolist() for _ in range(6)]
    prompts = []
    for i in range(n):
        shared = int(rng.integers(1, 6)) * CHUNK
        length = int(rng.integers(2, 11)) * CHUNK + int(rng.integers(0, CHUNK))
        own = rng.integers(0, 50_000, max(0, length - shared)).tolist()
        prompts.append((bases[i % 6][:shared] + own)[:length])
    return prompts


def full_tokens(prompt: list[int]) -> int:
    return len(prompt) // CHUNK * CHUNK


_PATTERN = np.random.default_rng(20_241_130).integers(
    0, 1 << 14, (LAYERS, 2, 1, HEADS, HEAD_DIM), dtype=np.int16
)  # a fixed value per (layer, K/V, head, dim)


def kv_for(tokens: list[int]) -> Any:
    """The KV bytes of ``tokens`` as a prompt: ``[LAYERS, 2, n, HEADS, HEAD_DIM]`` bfloat16, the
    fixed pattern XOR a 14-bit hash of (token id, position, digest of its chunk's prefix); never
    an inf or NaN pattern (bit 14 and the sign bit are clear)."""
    import torch

    n = len(tokens)
    arr = np.asarray(tokens, dtype=np.int64)
    digests = np.empty(n, dtype=np.int64)
    for start in range(0, n, CHUNK):
        end = min(start + CHUNK, n)
        digests[start:end] = zlib.crc32(arr[:end].tobytes())
    mix = (arr * 1031 + np.arange(n, dtype=np.int64) * 7 + digests * 13) % (1 << 30)
    h = ((mix * 0x9E3779B1) >> 16) & 0x3FFF
    v = torch.from_numpy(_PATTERN) ^ torch.from_numpy(h.astype(np.int16)).view(1, 1, n, 1, 1)
    return v.view(torch.bfloat16)


def slots_of(blocks: list[int], n: int) -> list[int]:
    return [blocks[i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE for i in range(n)]


def random_blocks(rng: random.Random, n_tokens: int) -> list[int]:
    return rng.sample(range(BLOCKS), -(-n_tokens // BLOCK_SIZE))


# --------------------------------------------------------------------------- worker side


class Worker:
    """The worker-side state: caches, adapter, and the checks of what came back."""

    def __init__(self, ns: Opts) -> None:
        import torch

        from dataplane.client import WorkerAdapter, allocate_kv_caches

        self.prompts = prompt_set(ns.prompts_seed)
        self.rng = random.Random(ns.seed)
        if ns.mode == "engine_driven":  # ordinary tensors: the adapter copies through the server's pool
            shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
            self.caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
        else:
            self.caches = allocate_kv_caches(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, torch.bfloat16)
        # token-slot views: [2, BLOCKS * BLOCK_SIZE, HEADS, HEAD_DIM] per layer, as int16
        self.flat = [c.view(2, BLOCKS * BLOCK_SIZE, HEADS, HEAD_DIM).view(torch.int16) for c in self.caches]
        self.w = WorkerAdapter(
            ns.endpoint,
            model_name="reliability",
            heartbeat_interval=ns.heartbeat,
            request_timeout=ns.request_timeout,
            transfer_mode=ns.mode,
        )
        self.w.register_kv_caches(self.caches)

    def fill(self, prompt: list[int], blocks: list[int]) -> None:
        import torch

        idx = torch.tensor(slots_of(blocks, len(prompt)), dtype=torch.long)
        data = kv_for(prompt).view(torch.int16)
        for layer, d in zip(self.flat, data, strict=True):
            layer[:, idx] = d

    def store(self, i: int) -> dict[str, Any]:
        prompt = self.prompts[i]
        blocks = random_blocks(self.rng, len(prompt))
        self.fill(prompt, blocks)
        t0 = time.monotonic()
        r = self.w.store_detail(prompt, blocks)
        return {"r": dataclasses.asdict(r), "s": time.monotonic() - t0}

    def retrieve(self, i: int) -> dict[str, Any]:
        """Retrieve prompt ``i`` into random sentinel-filled blocks and check every byte: the
        ``n`` tokens reported equal `kv_for`, every other slot of the blocks still the sentinel."""
        import torch

        prompt = self.prompts[i]
        blocks = random_blocks(self.rng, len(prompt))
        all_slots = torch.tensor(slots_of(blocks, len(blocks) * BLOCK_SIZE), dtype=torch.long)
        for layer in self.flat:
            layer[:, all_slots] = SENTINEL
        t0 = time.monotonic()
        n = self.w.retrieve(prompt, blocks)
        took = time.monotonic() - t0
        bad: list[str] = []
        if n % CHUNK or n > full_tokens(prompt):
            bad.append(f"retrieved {n} tokens of a {len(prompt)}-token prompt")
        n = min(n, len(prompt))
        want = kv_for(prompt[:n]).view(torch.int16)
        for li, layer in enumerate(self.flat):
            got = layer[:, all_slots[:n]]
            if not torch.equal(got, want[li]):
                wrong = (got != want[li]).nonzero()
                at = wrong[0].tolist()
                bad.append(f"layer {li}: {len(wrong)} wrong values, the first at (kv, token, head, dim) {at}")
            rest = layer[:, all_slots[n:]]
            if not bool((rest == SENTINEL).all()):
                bad.append(f"layer {li}: slots beyond the {n} retrieved tokens were written")
        return {"n": n, "bad": bad, "s": took}

    def state(self) -> dict[str, Any]:
        w = self.w
        return {
            "registrations": w.registrations,
            "refreshes": w.refreshes,
            "healthy": w.is_healthy,
            "misses": getattr(w, "misses", None),
        }


# The worker's end of its channel to the test: events out, commands in (set in `worker_entry`).
_chan: Connection | None = None
_out_lock = threading.Lock()  # one message at a time, from the main thread and the watcher


def emit(**fields: Any) -> None:
    assert _chan is not None
    with _out_lock:
        _chan.send(fields)


def _stop_flag() -> threading.Event:
    """Set when the test sends anything (``stop``) or its end of the channel closes."""
    stop = threading.Event()

    def read() -> None:
        assert _chan is not None
        with contextlib.suppress(EOFError, OSError):
            _chan.recv()
        stop.set()

    threading.Thread(target=read, name="stop", daemon=True).start()
    return stop


def run_loop(wk: Worker, role: str, pace_s: float) -> None:
    """The writer's or reader's loop. ``pace_s``: a random pause of up to that many seconds
    between requests (pacing of the load generator, so a 2-core machine keeps up)."""
    stop = _stop_flag()
    seq = 0
    while not stop.is_set():
        i = wk.rng.randrange(len(wk.prompts))
        seq += 1
        if role == "writer":
            emit(ev="store_begin", seq=seq, prompt=i)
            emit(ev="store_end", seq=seq, prompt=i, **wk.store(i))
        else:
            emit(ev="retrieve_begin", seq=seq, prompt=i)
            emit(ev="retrieve_end", seq=seq, prompt=i, **wk.retrieve(i))
        stop.wait(wk.rng.uniform(0, pace_s))


def run_agent(wk: Worker) -> None:
    assert _chan is not None
    done = threading.Event()

    def watch() -> None:
        last = None
        while True:
            now = wk.state()
            now.pop("misses")
            if now != last:
                emit(ev="state", **now)
                last = now
            if done.wait(0.02):
                return

    threading.Thread(target=watch, name="watch", daemon=True).start()
    while True:
        try:
            cmd = _chan.recv()
        except EOFError:
            break
        if cmd == "stop":
            break
        op = cmd["op"]
        if op == "store":
            emit(ev="stored", **wk.store(cmd["prompt"]))
        elif op == "retrieve":
            emit(ev="retrieved", **wk.retrieve(cmd["prompt"]))
        elif op == "check_all":
            emit(ev="checked", results=[wk.retrieve(i) for i in range(len(wk.prompts))])
        elif op == "state":
            emit(ev="state_now", **wk.state())
    done.set()


@dataclass(frozen=True)
class Opts:
    """A worker's settings."""

    endpoint: str
    mode: str = "server_driven"
    seed: int = 0
    prompts_seed: int = 0
    heartbeat: float = 1.0
    request_timeout: float = 20.0
    pace: float = 0.02


def worker_entry(chan: Connection, role: str, opts: Opts, shm_dir: str, log_path: str) -> None:
    """A worker process's body (forked from the fork server, where everything is imported):
    output to ``log_path``, segments in ``shm_dir``, events and commands over ``chan``."""
    global _chan
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ["KVWARDEN_SHM_DIR"] = shm_dir
    from dataplane.memory import shm

    shm.SHM_DIR = Path(shm_dir)
    _chan = chan
    wk = Worker(opts)
    mine = sorted(p.name for p in shm.SHM_DIR.glob(f"kvwarden-{os.getpid()}-*"))
    emit(ev="registered", instance_id=wk.w.instance_id, pid=os.getpid(), segments=mine)
    if role == "agent":
        run_agent(wk)
    else:
        run_loop(wk, role, opts.pace)
    wk.w.close()
    emit(ev="closed", **wk.state())


def _die_with_parent(parent: int) -> None:
    """SIGTERM when the test process dies (PR_SET_PDEATHSIG, kept across exec), so a test run
    killed from outside leaves no server behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the prctl
        sys.exit(1)


def serve_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="workers serve")
    ap.add_argument("--nofile-soft", type=int)
    ap.add_argument("--nofile-hard", type=int)
    ap.add_argument("--standby", action="store_true")
    ap.add_argument("--parent", type=int, required=True, help="the test process's pid")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    ns = ap.parse_args(argv)
    args = [a for a in ns.serve_args if a != "--"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if ns.nofile_hard is not None:
        hard = ns.nofile_hard
    if ns.nofile_soft is not None:
        soft = ns.nofile_soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    _die_with_parent(ns.parent)
    if not ns.standby:
        os.execv(sys.executable, [sys.executable, "-m", "app.cli", "serve", *args])
    import app.server  # noqa: F401  (imported now, so the start after the line is fast)
    import dataplane.server.runtime  # noqa: F401
    from app import cli

    print("standby", flush=True)
    if not sys.stdin.readline():
        return 0
    return cli.main(["serve", *args])


# ----------------------------------------------------------------------------- test side


_FORKS = mp.get_context("forkserver")
# the fork server imports these once; every worker is forked from it, ready in milliseconds
_FORKS.set_forkserver_preload(["torch", "zmq", "dataplane.client", "tests.reliability.workers"])


class Proc:
    """A worker process (forked from the fork server); a thread records every event it sends,
    with its arrival time."""

    def __init__(self, workdir: Path, name: str, role: str, opts: Opts, shm_dir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.opts = opts
        self.log_path = workdir / f"{name}.log"
        self.chan, theirs = _FORKS.Pipe()
        self.proc = _FORKS.Process(
            target=worker_entry,
            args=(theirs, role, opts, str(shm_dir), str(self.log_path)),
            name=name,
            daemon=True,
        )
        self.proc.start()
        theirs.close()  # the worker's end lives in the worker only: its death is our EOF
        assert self.proc.pid is not None
        self.pid: int = self.proc.pid
        self.events: list[tuple[float, Event]] = []
        self._eof = False
        self._cond = threading.Condition()  # guards events and _eof
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()
        self.info: Event = {}

    def _read(self) -> None:
        while True:
            try:
                ev = self.chan.recv()
            except (EOFError, OSError):
                break
            with self._cond:
                self.events.append((time.monotonic(), ev))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def wait_for(
        self, pred: Callable[[Event], bool], timeout: float, since: int = 0, what: str = ""
    ) -> Event:
        """The first event from index ``since`` on that matches ``pred``."""
        deadline = time.monotonic() + timeout
        i = since
        with self._cond:
            while True:
                while i < len(self.events):
                    ev = self.events[i][1]
                    i += 1
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0 or self._eof:
                    raise AssertionError(
                        f"{self.name}: no {what or 'event'} within {timeout:g}s (exit {self.proc.exitcode}); "
                        f"last events {[e for _, e in self.events][-5:]}\n{self.log()[-3000:]}"
                    )
                self._cond.wait(min(left, 0.5))

    def ev(self, kind: str, timeout: float = 60.0, since: int = 0) -> Event:
        return self.wait_for(lambda e: e.get("ev") == kind, timeout, since, kind)

    def of(self, kind: str) -> list[Event]:
        with self._cond:
            return [e for _, e in self.events if e.get("ev") == kind]

    def timed(self, kind: str) -> list[tuple[float, Event]]:
        with self._cond:
            return [(t, e) for t, e in self.events if e.get("ev") == kind]

    def cursor(self) -> int:
        with self._cond:
            return len(self.events)

    def send(self, msg: Any) -> None:
        self.chan.send(msg)

    def command(self, reply: str, timeout: float = 60.0, **cmd: Any) -> Event:
        since = self.cursor()
        self.send(cmd)
        return self.ev(reply, timeout, since)

    def registered(self, timeout: float = 90.0) -> Event:
        self.info = self.ev("registered", timeout)
        return self.info

    @property
    def instance_id(self) -> int:
        return int(self.info["instance_id"])

    def log(self) -> str:
        """What the worker wrote (nothing when it died before its first line)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def finish(self, timeout: float = 30.0) -> int | None:
        """Tell the worker to stop (close its adapter and exit); returns its exit code."""
        with contextlib.suppress(OSError):
            self.send("stop")
        self.proc.join(timeout)
        self.stop()
        return self.proc.exitcode

    def sigkill(self) -> None:
        """SIGKILL, reap, and read what it sent before it died."""
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(30)
        self._reader.join(10)

    def stop(self) -> None:
        """Teardown: SIGKILL if still running, reap, close our end."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(30)
        self._reader.join(10)
        self.chan.close()


class Serve(ServerProcess):
    """`kvwarden serve` through the `serve_main` wrapper: given (or free) ports, so a restart can
    take the same ones, an optional open-files limit and an optional standby start."""

    def __init__(
        self,
        workdir: Path,
        *args: str,
        env: dict[str, str],
        port: int | None = None,
        http_port: int | None = None,
        nofile: tuple[int | None, int | None] = (None, None),
        standby: bool = False,
        tag: str = "",
    ) -> None:
        self.port = port or free_port()
        self.http_port = http_port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = workdir / f"server-{self.port}{tag}.out"
        self.stderr_path = workdir / f"server-{self.port}{tag}.err"
        wrapper = []
        if nofile[0] is not None:
            wrapper += ["--nofile-soft", str(nofile[0])]
        if nofile[1] is not None:
            wrapper += ["--nofile-hard", str(nofile[1])]
        if standby:
            wrapper.append("--standby")
        cmd = [sys.executable, "-m", "tests.reliability.workers", "serve", "--parent", str(os.getpid())]
        cmd += [*wrapper, "--"]
        cmd += ["--port", str(self.port), "--http-port", str(self.http_port), *args]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
            )

    def go(self, timeout: float = 60.0) -> None:
        """Start serving (a standby server), once its imports are done."""
        wait_until(
            lambda: "standby" in self.output() or self.proc.poll() is not None, timeout, what="standby"
        )
        rc = self.proc.poll()
        assert rc is None, (
            f"the standby server exited with {rc} before it was told to serve:\n{self.output()}"
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        self.proc.stdin.close()

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def tracebacks(self) -> int:
        return self.output().count("Traceback")


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes, float]:
    """One GET on a fresh connection: (status, body, seconds)."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(), time.monotonic() - t0
    finally:
        conn.close()


def tracked(http_port: int, instance_id: int) -> bool:
    status, _, _ = http_get(http_port, f"/instances/{instance_id}")
    assert status in (200, 404), status
    return status == 200


def segments_of(directory: Path, pids: set[int]) -> list[str]:
    return sorted(
        p.name for p in directory.iterdir() if any(p.name.startswith(f"kvwarden-{pid}-") for pid in pids)
    )


@contextlib.contextmanager
def private_shm_dir() -> Iterator[Path]:
    """A segment directory of its own on the shm tmpfs (``KVWARDEN_SHM_DIR`` of the processes
    of one test), so no other server's start-up sweep races the segments a test watches."""
    d = Path(tempfile.mkdtemp(prefix="kvw-rel-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def env_for(shm_dir: Path) -> dict[str, str]:
    return subprocess_env(KVWARDEN_SHM_DIR=str(shm_dir))


if __name__ == "__main__":
    assert sys.argv[1] == "serve", sys.argv
    sys.exit(serve_main(sys.argv[2:]))
