"""Soak: workers store, retrieve, crash and come back for minutes against one server.

Deselected unless ``KVWARDEN_SLOW=1`` (see tests/conftest.py); ``KVWARDEN_SOAK_SECONDS`` sets the
duration (default 120). As with a real model, a prompt's KV is a function of its tokens: every
writer fills its cache with the same random data and places a prompt at the same blocks, so any
writer's copy of a chunk is byte-identical. Writers store random prompts and dump the expected
bytes; a reader retrieves random prompts and compares byte
for byte; every few seconds a writer is SIGKILLed and a fresh one starts. At the end: no error,
every retrieved byte right, every dead writer reaped, no kvwarden segment left in /dev/shm, and
the server's memory bounded.
"""

from __future__ import annotations

import os
import random
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from dataplane.memory import shm
from tests.conftest import ServerFactory
from tests.e2e.workers import LAYOUT, WorkerProcess
from tests.helpers import ServerProcess, wait_until

SECONDS = float(os.environ.get("KVWARDEN_SOAK_SECONDS", "120"))
# the per-test timeout of the default suite is too short for a soak: its duration plus set-up
pytestmark = [pytest.mark.slow, pytest.mark.timeout(SECONDS + 240)]

CHUNK = 32
BS = LAYOUT["block_size"]


def http_status(server: ServerProcess, path: str) -> int:
    """The sidecar's status code for ``GET path`` (an instance is tracked: 200; gone: 404)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}", timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def server(make_server: ServerFactory) -> ServerProcess:
    return make_server(
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "0.004",
        "--worker-disconnect-grace-seconds",
        "1",
        "--log-level",
        "warning",
    )


def test_soak(server: ServerProcess, tmp_path: Path) -> None:

    seconds = SECONDS
    rng = random.Random(7)
    writers: list[WorkerProcess] = []
    dead: list[int] = []
    expected: dict[int, tuple[list[int], bytes]] = {}  # prompt seed -> (tokens, bytes)
    n_worker = 0

    def new_writer() -> WorkerProcess:
        nonlocal n_worker
        n_worker += 1
        w = WorkerProcess(tmp_path, server.endpoint, f"w{n_worker}", fill="random", seed=1)
        pids.append(w.pid)
        w.wait_ready()
        return w

    pids: list[int] = []
    reader = WorkerProcess(tmp_path, server.endpoint, "reader")
    pids.append(reader.pid)
    try:
        reader.wait_ready()
        writers = [new_writer(), new_writer()]
        rss_start = _rss_kib(server.proc.pid)
        end = time.monotonic() + seconds
        next_kill = time.monotonic() + 5
        checked = stores = 0
        while time.monotonic() < end:
            assert server.proc.poll() is None, server.output()
            seed = rng.randrange(40)
            tokens = [seed * 10_000 + i for i in range(rng.randrange(2, 6) * CHUNK)]
            w = rng.choice(writers)
            blocks = random.Random(seed).sample(range(LAYOUT["blocks"]), 12)[: len(tokens) // BS]
            r = w.store(tokens, blocks)
            stores += 1
            # every full chunk is accounted for: written now, already held, or refused (L1 full)
            assert r["chunks"] == len(tokens) // CHUNK, r
            assert r["stored"] + r["present"] + r["rejected"] == r["chunks"], r
            if seed not in expected or len(expected[seed][0]) < len(tokens):
                expected[seed] = (tokens, w.dump(blocks, len(tokens), tmp_path / "e.bin"))
            probe = rng.choice(list(expected))
            want_tokens, want = expected[probe]
            rblocks = rng.sample(range(LAYOUT["blocks"]), len(want_tokens) // BS)
            n = reader.retrieve(want_tokens, rblocks, tmp_path / "got.bin")
            got = (tmp_path / "got.bin").read_bytes()
            # whatever prefix is still in L1 must be exactly what was stored
            assert got == want[: len(got)], f"prompt {probe}: retrieved bytes differ"
            checked += n
            if time.monotonic() > next_kill:
                victim = writers.pop(rng.randrange(len(writers)))
                victim.stop()  # SIGKILL, then close our ends of its pipes
                dead.append(int(victim.info["instance_id"]))
                writers.append(new_writer())
                next_kill = time.monotonic() + 5
        rss_end = _rss_kib(server.proc.pid)
        assert stores > 20 and checked > 0
        for w in writers:
            assert w.close() == 0
        assert reader.close() == 0
        for iid in dead:  # every killed writer was reaped (disconnect detection)
            wait_until(
                lambda iid=iid: http_status(server, f"/instances/{iid}") == 404,
                15,
                what=f"reap of killed worker {iid}",
            )
        ours = tuple(f"kvwarden-{pid}-" for pid in pids)
        wait_until(
            lambda: not [p for p in shm.SHM_DIR.iterdir() if p.name.startswith(ours)],
            15,
            what="every segment of every worker, live or killed, unlinked",
        )
        assert rss_end < rss_start * 1.5 + 64 * 1024, (rss_start, rss_end)
    finally:
        for w in writers:
            w.stop()
        reader.stop()
