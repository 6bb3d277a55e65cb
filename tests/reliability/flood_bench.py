"""The bench of the flood tests (`tests.reliability.test_registration_floods`,
`tests.reliability.test_connection_floods`): a real `kvwarden serve` started with a soft limit of
1,024 open files, a real worker registered before the flood, and a PING prober on its own
connection.

During and after each flood: the prober keeps being answered (within a bound: the ``timed``
variant, a ``bench`` test), a real worker keeps storing and retrieving, a new worker registers and
stores, ``/livez`` answers, the log carries no flood of tracebacks, and the server exits 0 on
SIGTERM (`end_bench`).

The server is started through ``python -m tests.reliability.workers serve --nofile-soft 1024``,
which calls ``setrlimit(RLIMIT_NOFILE, (1024, hard))`` and execs ``python -m app.cli serve``.
Measurements are printed (``pytest -s``).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import zmq

from app import logs
from dataplane.client import WorkerAdapter, allocate_kv_caches
from dataplane.wire.messages import Ping
from dataplane.wire.protocol import ReplyFrame, decode_reply, encode_message
from tests.helpers import wait_until
from tests.reliability.workers import CHUNK, Opts, Proc, Serve, env_for, http_get

# The bounds on answer times are measurements: asserted only by the ``timed`` variant of each
# flood (marked ``bench``); the default one checks that everything was answered at all, its
# timeouts (PING_GUARD_S, LIVEZ_BOUND_S + 3) only guards against a server that never answers.
PING_BOUND_S = 0.5  # the slowest PING answer allowed during a flood (a loaded 2-core machine)
LIVEZ_BOUND_S = 2.0
PING_LATE_S = 2.0  # timed: a PING answered later is a miss
PING_GUARD_S = 8.0  # untimed: a PING unanswered this long is a miss (the server stopped answering)
PAST_LIMIT = 1100  # connections against a hard limit of 1,024


def dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


_RID = iter(range(1, 1 << 62))


def send(sock: zmq.Socket[Any], msg: Any) -> int:
    rid = next(_RID)
    sock.send(encode_message(rid, msg))
    return rid


def replies(sock: zmq.Socket[Any], rids: list[int], timeout: float = 30.0) -> dict[int, ReplyFrame]:
    """The replies to ``rids`` (sent over ``sock``), by request id."""
    got: dict[int, ReplyFrame] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(rids):
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000), zmq.POLLIN), f"{len(got)} of {len(rids)} replies"
        r = decode_reply(sock.recv())
        got[r.request_id] = r
    return got


def code_of(r: ReplyFrame) -> str:
    return "OK" if r.ok else str(r.body["code"])


class Prober(threading.Thread):
    """PINGs (a probe: no instance) over a connection of its own, one every ``every_s`` (the
    pacing of a probe), recording each answer's time; an answer later than ``late_s`` counts
    as a miss."""

    def __init__(
        self, ctx: zmq.Context[Any], endpoint: str, every_s: float = 0.02, late_s: float = 2.0
    ) -> None:
        super().__init__(name="ping-prober", daemon=True)
        self.sock = dealer(ctx, endpoint)
        self.every_s, self.late_s = every_s, late_s
        self.rtts: list[float] = []
        self.misses = 0
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            t0 = time.monotonic()
            rid = send(self.sock, Ping(None, None))
            while True:
                left = self.late_s - (time.monotonic() - t0)
                if left <= 0 or not self.sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    self.misses += 1
                    break
                if decode_reply(self.sock.recv()).request_id == rid:
                    self.rtts.append(time.monotonic() - t0)
                    break

    def finish(self) -> tuple[int, float, float]:
        """(answers, median, slowest) in seconds."""
        self._halt.set()
        self.join(self.late_s + 10)
        if not self.sock.closed:
            self.sock.close(linger=0)
        s = sorted(self.rtts)
        return len(s), s[len(s) // 2], s[-1]


@dataclass
class Bench:
    server: Serve
    live: Proc  # a real worker process, registered before the flood
    prober: Prober
    base_fds: int
    timed: bool = False  # assert the answer times too (the bench variant)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        """Teardown: whatever is still running stops."""
        if self.prober.is_alive():
            self.prober.finish()
        self.live.stop()
        self.server.stop()

    def livez(self) -> tuple[int, float]:
        status, body, took = http_get(self.server.http_port, "/livez", LIVEZ_BOUND_S + 3)
        assert not self.timed or took <= LIVEZ_BOUND_S, took
        assert status == 503 or body == b'{"status":"pass"}', (status, body)
        return status, took

    def live_works(self, prompt: int) -> None:
        r = self.live.command("stored", op="store", prompt=prompt)["r"]
        assert r["chunks"] > 0 and r["rejected"] == 0 and r["stored"] + r["present"] == r["chunks"], r
        got = self.live.command("retrieved", op="retrieve", prompt=prompt)
        assert got["bad"] == [] and got["n"] == r["chunks"] * CHUNK, got

    def tracked(self) -> int:
        status, body, _ = http_get(self.server.http_port, "/status")
        assert status == 200, body
        return int(json.loads(body)["worker_liveness"]["tracked_instances"])


def nofile_of(pid: int) -> tuple[str, str]:
    """The soft and hard "Max open files" of ``pid``."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError(f"no open-files limit in /proc/{pid}/limits")


def start_bench(
    tmp: Path,
    shm_dir: Path,
    ctx: zmq.Context[Any],
    *args: str,
    hard: int | None = None,
    timed: bool = False,
) -> Bench:
    env = env_for(shm_dir)
    server = Serve(
        tmp,
        "--chunk-size",
        str(CHUNK),
        "--worker-disconnect-grace-seconds",
        "1",
        "--l1-size-gb",
        "0.05",
        *args,
        env=env,
        nofile=(1024, hard),
    )
    live = Proc(tmp, "live", "agent", Opts(server.endpoint, seed=1, prompts_seed=1, heartbeat=0.5), shm_dir)
    prober: Prober | None = None
    try:
        server.wait_ready()
        live.registered()
        soft, hard_now = (int(v) for v in nofile_of(server.proc.pid))
        if hard is None:  # the server raised its soft limit of 1,024 to the hard one, and said so
            assert soft == hard_now > 1024, (soft, hard_now)
            assert f"soft limit raised from 1024 to {soft}" in server.output(), server.output()
        else:
            assert soft == hard_now == hard, (soft, hard_now)
        prober = Prober(ctx, server.endpoint, late_s=PING_LATE_S if timed else PING_GUARD_S)
        prober.start()
        wait_until(lambda: prober is not None and prober.rtts, 10, what="a first PING answer")
        bench = Bench(server, live, prober, server.fds(), timed)
        bench.live_works(0)
    except BaseException:
        if prober is not None:
            prober.finish()
        live.stop()
        server.stop()
        raise
    return bench


ACCEPT_ERROR = "ERROR asyncio: socket.accept() out of system resource"
SUPPRESSED = re.compile(r"suppressed (\d+) similar messages: (.*)")


def end_bench(b: Bench, accept_errors: bool = False) -> None:
    """The prober's PINGs were all answered (timed: in time), the worker closes, the server
    exits 0 on SIGTERM and its log holds no traceback; with ``accept_errors``, none but those
    of asyncio's ERROR records (a refused accept, and the retries it scheduled) that the log's
    rate limiter (`app.logs`) let through: at most its burst per kind and window."""
    n, p50, worst = b.prober.finish()
    assert b.prober.misses == 0, (b.prober.misses, b.prober.late_s)
    assert not b.timed or worst <= PING_BOUND_S, worst
    assert b.live.finish() == 0, b.live.log()
    t0 = time.monotonic()
    b.server.sigterm()
    rc = b.server.proc.wait(30)
    out = b.server.output()
    assert rc == 0, out
    tracebacks = out.count("Traceback")
    asyncio_errors = len(re.findall(r"ERROR asyncio: (?!suppressed \d+ similar)", out))
    assert tracebacks == (asyncio_errors if accept_errors else 0), out
    windows = 1 + int((time.monotonic() - b.started) // logs.DEFAULT_WINDOW_S)
    burst = logs.DEFAULT_BURST * windows  # of each kind: the refused accepts, the retries
    assert out.count(ACCEPT_ERROR) <= burst and tracebacks <= 2 * burst, out
    suppressed = {m.group(2)[:60]: int(m.group(1)) for m in SUPPRESSED.finditer(out)}
    b.notes.append(
        f"PING x{n}: median {p50 * 1000:.1f} ms, slowest {worst * 1000:.1f} ms; log {len(out.splitlines())} "
        f"lines, {tracebacks} tracebacks, suppressed {suppressed}; SIGTERM exit {rc} in "
        f"{time.monotonic() - t0:.2f}s"
    )
    print("\n" + "\n".join(b.notes))


def new_worker_works(endpoint: str, mode: str = "server_driven") -> None:
    """A fresh WorkerAdapter (in this process) registers, stores, retrieves and closes."""
    caches = allocate_kv_caches(2, 8, 16, 2, 8, torch.bfloat16)
    w = WorkerAdapter(
        endpoint, model_name="flood-check", heartbeat_interval=1.0, request_timeout=10.0, transfer_mode=mode
    )
    try:
        w.register_kv_caches(caches)
        tokens = list(range(4 * CHUNK))
        assert w.store(tokens, list(range(8)))
        assert w.retrieve(tokens, list(range(8))) == 4 * CHUNK
    finally:
        w.close()
