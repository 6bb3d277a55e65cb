"""The sidecar end to end: a real `kvwarden serve`, two real worker processes, the real CLI.

Worker A is reaped through `kvwarden reap` while alive: it disappears (its context and its
memory mapping released), learns from its next PING that the server no longer knows it, and
registers exactly one fresh context. Worker B is untouched throughout.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ROOT, ServerProcess, subprocess_env, wait_until

TOKEN = "e2e-admin-token"
CHUNK = 16
TOKENS = 64  # four chunks, in blocks 0..3 of the tiny layout

WORKER = r"""
import sys, threading
import torch
from dataplane.client import WorkerAdapter, allocate_kv_caches

endpoint, model = sys.argv[1], sys.argv[2]
caches = allocate_kv_caches(2, 8, 16, 2, 8, torch.bfloat16)
g = torch.Generator().manual_seed(len(model))
for c in caches:
    c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
blocks = [0, 1, 2, 3]
tokens = list(range(64))
original = [c[:, blocks].clone() for c in caches]
w = WorkerAdapter(endpoint, model_name=model, heartbeat_interval=0.5, request_timeout=10.0)
w.register_kv_caches(caches)
lock = threading.Lock()

def say(*parts):
    with lock:
        print(*parts, flush=True)

say("READY", w.instance_id, w.segments[0], int(w.store(tokens, blocks)))

def watch_registrations():
    seen = w.registrations
    say("REGISTRATIONS", seen)
    tick = threading.Event()
    while not tick.wait(0.01):
        if w.registrations != seen:
            seen = w.registrations
            say("REGISTRATIONS", seen)

threading.Thread(target=watch_registrations, daemon=True).start()
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "store":
        say("STORED", int(w.store(tokens, blocks)))
    elif cmd == "retrieve":
        for c in caches:
            c[:, blocks] = 0
        n = w.retrieve(tokens, blocks)
        same = all(torch.equal(c[:, blocks], o) for c, o in zip(caches, original))
        say("RETRIEVED", n, int(same))
    elif cmd == "quit":
        w.close()
        say("BYE")
        break
"""


class Worker:
    """A worker process; its stdout lines collected by a reader thread."""

    def __init__(self, script: Path, endpoint: str, model: str, workdir: Path) -> None:
        self.model = model
        self.err_path = workdir / f"worker-{model}.err"
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), endpoint, model],
                cwd=ROOT,
                env=subprocess_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = self.expect("READY", 120).split()
        self.id = int(ready[1])
        self.segment = ready[2]
        assert ready[3] == "1", "the first store failed"

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.strip())
                self._cond.notify_all()
        with self._cond:
            self.lines.append("<EOF>")
            self._cond.notify_all()

    def expect(self, prefix: str, timeout: float = 30.0, start: int = 0) -> str:
        """The first line from index ``start`` on that starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines[start:]:
                    if line.startswith(prefix):
                        return line
                    if line == "<EOF>":
                        raise AssertionError(f"worker {self.model} exited: " + self.err_path.read_text())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"worker {self.model}: no {prefix!r} in {timeout:g}s; got {self.lines}"
                    )
                self._cond.wait(left)

    def registrations(self) -> list[int]:
        with self._cond:
            return [int(ln.split()[1]) for ln in self.lines if ln.startswith("REGISTRATIONS")]

    def command(self, cmd: str, answer: str, timeout: float = 30.0) -> list[str]:
        with self._cond:
            start = len(self.lines)
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.expect(answer, timeout, start).split()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.command("quit", "BYE", 30)
                self.proc.wait(30)
            except (AssertionError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path / "server",
        "--worker-reap-timeout-seconds",
        "30",
        "--chunk-size",
        str(CHUNK),
        "--l1-size-gb",
        "0.01",
        env=subprocess_env(KVWARDEN_ADMIN_TOKEN=TOKEN),
    )
    try:
        srv.wait_ready()
        url = f"http://127.0.0.1:{srv.http_port}"
        wait_until(lambda: _livez(url), 60, what="the HTTP sidecar")
        yield srv
    finally:
        rc = srv.stop()
    # SIGTERM: the sidecar and the data plane both stop within their bounds
    assert rc == 0, srv.output()
    assert "sidecar: stopped" in srv.output()


@pytest.fixture
def workers(server: ServerProcess, tmp_path: Path) -> Iterator[tuple[Worker, Worker]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    made: list[Worker] = []
    try:
        made.append(Worker(script, server.endpoint, "model-a", tmp_path))
        made.append(Worker(script, server.endpoint, "model-b", tmp_path))
        yield made[0], made[1]
    finally:
        for w in made:
            w.stop()


def _livez(url: str) -> bool:
    try:
        return httpx.get(url + "/livez", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def cli(server: ServerProcess, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    env.pop("KVWARDEN_ADMIN_TOKEN", None)
    if token is not None:
        env["KVWARDEN_ADMIN_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args, "--url", f"http://127.0.0.1:{server.http_port}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def server_mappings(server: ServerProcess, segment: str) -> int:
    """Mappings of the worker's segment in the server process."""
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text().splitlines()
    return sum(1 for ln in maps if ln.endswith(f"/{segment}") or ln.endswith(f"/{segment} (deleted)"))


def test_reap_a_live_worker_end_to_end(server: ServerProcess, workers: tuple[Worker, Worker]) -> None:
    a, b = workers
    http = httpx.Client(base_url=f"http://127.0.0.1:{server.http_port}", timeout=30)

    def status() -> dict[str, Any]:
        r = http.get("/status")
        assert r.status_code == 200
        doc: dict[str, Any] = r.json()
        return doc

    def instances() -> dict[int, dict[str, Any]]:
        return {i["instance_id"]: i for i in status()["instances"]}

    def when(pred: Callable[[dict[int, dict[str, Any]]], bool]) -> Callable[[], bool]:
        return lambda: pred(instances())

    # both listed, with live figures: pinged, recently seen, stored chunks in L1
    wait_until(
        when(
            lambda i: (
                {a.id, b.id} <= set(i)
                and all(
                    i[x]["has_liveness_signal"]
                    and i[x]["last_seen_seconds_ago"] < 2.0
                    and i[x]["registered_seconds_ago"] >= 1.0
                    for x in (a.id, b.id)
                )
            )
        ),
        30,
        what="both workers pinging",
    )
    doc = status()
    assert doc["worker_liveness"]["tracked_instances"] == 2
    assert doc["storage"]["l1"]["chunks"] == 2 * TOKENS // CHUNK
    assert {i["model_name"] for i in doc["instances"]} == {"model-a", "model-b"}
    assert server_mappings(server, a.segment) == 1
    assert server_mappings(server, b.segment) == 1

    # the CLI's two views
    out = cli(server, "status", "--json")
    assert out.returncode == 0, out.stderr
    assert {i["instance_id"] for i in json.loads(out.stdout)["instances"]} == {a.id, b.id}
    out = cli(server, "status")
    assert out.returncode == 0, out.stderr
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.split()[:1] in ([str(a.id)], [str(b.id)])]
    assert sorted(r[3] for r in rows) == ["model-a", "model-b"]
    assert "INSTANCE ID" in out.stdout

    t_before = time.monotonic()  # before this read of B's age: brackets the server's "now"
    b_before = instances()[b.id]["registered_seconds_ago"]
    t_read = time.monotonic()
    lines_before = len(a.lines)

    # reap A through the real CLI
    out = cli(server, "reap", str(a.id))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"instance {a.id} reaped" in out.stdout

    # A's old context is gone: absent, or (once its next PING re-registered it) a fresh one
    wait_until(
        when(lambda i: a.id not in i or i[a.id]["registered_seconds_ago"] < time.monotonic() - t_before),
        30,
        what="A's old context to disappear",
    )
    wait_until(
        lambda: f"released instance {a.id} (admin)" in server.output(),
        30,
        what="the server to release A's mapping",
    )
    # A re-registers exactly once: one fresh context, listed once, mapped once
    a.expect("REGISTRATIONS 2", 30, lines_before)
    wait_until(
        when(
            lambda i: (
                a.id in i and i[a.id]["has_liveness_signal"] and i[a.id]["registered_seconds_ago"] >= 1.5
            )
        ),
        30,
        what="A to keep pinging its fresh context",
    )
    assert a.registrations() == [1, 2]
    doc = status()
    assert [i["instance_id"] for i in doc["instances"]].count(a.id) == 1
    assert doc["worker_liveness"]["tracked_instances"] == 2
    # A's fresh context was registered after the reap began (an ordering on the one monotonic
    # clock the server and this test read), B's (registered before it) is older
    ages = {i["instance_id"]: i["registered_seconds_ago"] for i in doc["instances"]}
    assert ages[a.id] < time.monotonic() - t_before
    assert ages[b.id] > ages[a.id]
    assert server_mappings(server, a.segment) == 1  # the old mapping released, the new one held
    assert "reaped_total" in doc["worker_liveness"] and doc["worker_liveness"]["reaped_total"] == 1
    metrics = http.get("/metrics").text
    assert 'kvwarden_instances_reaped_total{reason="admin"} 1.0' in metrics

    # B untouched: the same context (registered at the same moment: its age grew exactly as
    # the clock did between the two reads, each bracketed by this test's readings of the same
    # monotonic clock; ages are shown to the millisecond), still stores and retrieves
    t_now = time.monotonic()
    b_now = instances()[b.id]
    t_now_read = time.monotonic()
    grew = b_now["registered_seconds_ago"] - b_before
    assert t_now - t_read - 0.002 <= grew <= t_now_read - t_before + 0.002, (grew, b_before)
    assert b.registrations() == [1]
    assert server_mappings(server, b.segment) == 1
    assert b.command("store", "STORED") == ["STORED", "1"]
    assert b.command("retrieve", "RETRIEVED") == ["RETRIEVED", str(TOKENS), "1"]
    # and A, re-registered, works again too
    assert a.command("store", "STORED") == ["STORED", "1"]
    assert a.command("retrieve", "RETRIEVED") == ["RETRIEVED", str(TOKENS), "1"]
    http.close()


def test_reap_exit_codes_for_unknown_ids_and_bad_tokens(
    server: ServerProcess, workers: tuple[Worker, Worker]
) -> None:
    a, b = workers
    unknown = (max(a.id, b.id) + 1) % (1 << 63)
    if unknown in (a.id, b.id):
        unknown = 12345
    out = cli(server, "reap", str(unknown))
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stderr.strip() == f"kvwarden reap: instance {unknown} is not tracked by the server"
    out = cli(server, "reap", str(a.id), token="not-the-token")
    assert out.returncode == 4, out.stdout + out.stderr
    assert "unauthorised" in out.stderr
    out = cli(server, "reap", str(a.id), token=None)
    assert out.returncode == 4
    out = cli(server, "reap", "not-a-number")
    assert out.returncode == 2
    out = cli(server, "reap", str(a.id), "--dry-run")
    assert out.returncode == 0 and "dry run" in out.stdout
    # none of these released anything
    ids = {
        i["instance_id"]
        for i in httpx.get(f"http://127.0.0.1:{server.http_port}/status", timeout=30).json()["instances"]
    }
    assert ids == {a.id, b.id}
    assert a.registrations() == [1] and b.registrations() == [1]
    # every admin call left one audit line in the server's log
    wait_until(lambda: server.output().count("audit: admin reap_instance") >= 4, 30, what="the audit lines")
    assert server.output().count("audit: admin reap_instance") == 4


def test_serve_exits_1_when_the_http_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        srv = ServerProcess(tmp_path / "server", "--http-port", str(port))
        try:
            rc = srv.proc.wait(60)
        finally:
            srv.stop()
    assert rc == 1
    err = srv.stderr_path.read_text()
    assert (
        f"kvwarden serve: cannot start the HTTP sidecar: cannot listen on "
        f"http://127.0.0.1:{port}: Address already in use\n"
    ) in err, err
