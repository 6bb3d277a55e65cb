"""`kvwarden serve`'s process-level limits, end to end, on real server processes: the soft limit
on open files raised and logged, the sidecar's connection limit and idle deadline (40 idle HTTP
connections neither lock out `/livez` for long nor the data plane at all), the warning on binds
beyond loopback, and the admin token file, with `kvwarden reap` and refused at start."""

from __future__ import annotations

import os
import re
import resource
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from app.cli import EXIT_OK, EXIT_UNAUTHORISED, EXIT_USAGE, main
from app.logs import DEFAULT_BURST, DEFAULT_WINDOW_S
from app.server import KEEP_ALIVE_S
from dataplane.client import WorkerAdapter, allocate_kv_caches
from tests.conftest import ServerFactory
from tests.helpers import ServerProcess, wait_until

TOKEN = "e2e-token-from-a-file"
CHUNK = "16"
LAYOUT = (2, 8, 16, 2, 8)  # layers, blocks, block size, kv heads, head dim
IDLE = 40
REFUSED = DEFAULT_BURST + 21  # refused admin calls in a row; a burst of their audit lines passes


@pytest.fixture(autouse=True)
def _no_admin_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers inherit this environment: no token from it (a token file and a token clash)."""
    for k in ("KVWARDEN_ADMIN_TOKEN", "KVWARDEN_ADMIN_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)


def nofile_limits(pid: int) -> tuple[str, str]:
    """The soft and hard "Max open files" of ``pid``, as /proc/PID/limits shows them."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return soft, hard
    raise AssertionError(f"no open-files limit in /proc/{pid}/limits")


@pytest.fixture
def nofile() -> Iterator[tuple[int, int]]:
    """This process's limits on open files, put back at teardown."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_serve_raises_its_soft_open_files_limit_and_logs_both(
    make_server: ServerFactory, nofile: tuple[int, int]
) -> None:
    soft, hard = nofile
    low = 512 if hard == resource.RLIM_INFINITY else min(512, hard - 1)
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # the server inherits it...
    try:
        srv = make_server(ready=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # ...this process only for a moment
    srv.wait_ready()
    soft_now, hard_now = nofile_limits(srv.proc.pid)
    want = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    assert hard_now == want
    if hard != resource.RLIM_INFINITY:
        assert soft_now == want
    log = srv.output()
    m = re.search(r"INFO kvwarden: open files \(RLIMIT_NOFILE\): soft limit raised from (\d+) to (\d+)", log)
    assert m is not None, log
    assert int(m.group(1)) == low and m.group(2) == soft_now, log
    assert f"(hard limit {want})" in log
    assert "beyond loopback" not in log, log  # the default binds are loopback: no warning


def closed_by_peer(sock: socket.socket) -> bool:
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def livez_ok(srv: ServerProcess) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{srv.http_port}/livez", timeout=2.0).status_code == 200
    except httpx.TransportError:
        return False


def livez_503(url: str) -> httpx.Response | None:
    """GET /livez on a fresh connection: the response when it is a 503, else None."""
    with httpx.Client(base_url=url, timeout=5.0) as c:
        r = c.get("/livez")
    return r if r.status_code == 503 else None


def store_through(srv: ServerProcess) -> tuple[bool, int]:
    """A fresh WorkerAdapter registers, stores 64 tokens and looks them up; closed after."""
    w = WorkerAdapter(srv.endpoint, model_name="limits", heartbeat_interval=10.0, request_timeout=10.0)
    try:
        caches = allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16)
        w.register_kv_caches(caches)
        tokens = list(range(64))
        return w.store(tokens, [0, 1, 2, 3]), w.lookup(tokens)
    finally:
        w.close()


def test_idle_http_connections_neither_lock_out_livez_nor_the_data_plane(make_server: ServerFactory) -> None:
    srv = make_server("--http-max-connections", "8", "--chunk-size", CHUNK)
    url = f"http://127.0.0.1:{srv.http_port}"
    wait_until(lambda: livez_ok(srv), 30, what="the sidecar (it starts after the data plane answers)")
    idle = [socket.create_connection(("127.0.0.1", srv.http_port)) for _ in range(IDLE)]
    idle[0].sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n")  # a request head never finished
    try:
        # beyond the limit a request is answered at once: 503, and its connection closed
        r = wait_until(lambda: livez_503(url), 5, what="a 503 from /livez")
        assert r.text == "Service Unavailable" and r.headers["connection"] == "close"
        assert store_through(srv) == (True, 64)  # the data plane does not care
        # the idle connections (the unfinished head too) are closed by the server after its deadline...
        wait_until(
            lambda: all(closed_by_peer(s) for s in idle), KEEP_ALIVE_S + 10, what="idle connections closed"
        )
        # ...and /livez is served again, on a fresh connection
        with httpx.Client(base_url=url, timeout=5.0) as c:
            assert c.get("/livez").json() == {"status": "pass"}
    finally:
        for s in idle:
            s.close()
    log = srv.output()
    assert "(at most 8 connections, idle ones closed after 5 s)" in log, log
    assert "Exceeded concurrency limit." in log, log


ACCEPT_FAILED = "socket.accept() out of system resource"


def test_descriptor_exhaustion_does_not_flood_the_log(make_server: ServerFactory) -> None:
    """The server's descriptors are capped a few above those it holds (prlimit, on the running
    process), then clients queue far more HTTP connections than it can accept: asyncio's accept
    loop logs an error with a traceback for every failed accept (thousands a second); the rate
    limiter lets a burst of them through per 10 s and reports the rest in one line."""
    t_start = time.monotonic()
    srv = make_server("--http-max-connections", "4096")
    wait_until(lambda: livez_ok(srv), 30, what="the sidecar (it starts after the data plane answers)")
    pid = srv.proc.pid
    cap = len(os.listdir(f"/proc/{pid}/fd")) + 16
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (cap, cap))
    queued = [socket.create_connection(("127.0.0.1", srv.http_port)) for _ in range(200)]
    try:
        summary = re.compile(rf"ERROR asyncio: suppressed (\d+) similar messages: {re.escape(ACCEPT_FAILED)}")
        m = wait_until(lambda: summary.search(srv.output()), 25, what="the suppressed-lines report")
        assert int(m.group(1)) >= 100, srv.output()[-3000:]
    finally:
        for s in queued:
            s.close()
    log = srv.output()
    passed = [ln for ln in log.splitlines() if ln.endswith(f"ERROR asyncio: {ACCEPT_FAILED}")]
    windows = len(summary.findall(log)) + 1
    assert 1 <= len(passed) <= DEFAULT_BURST * windows, log[-3000:]
    assert log.count("Traceback") == len(passed)
    # once the clients are gone, their descriptors come back and the sidecar answers again
    wait_until(lambda: livez_ok(srv), 30, what="/livez answering again")
    # at stop, the accept retries asyncio scheduled by the thousand fail on the closed socket, each
    # with a traceback and a message of its own (the timer's deadline): they are limited too
    assert srv.stop() == 0
    log = srv.output()
    # two kinds of line (the accept error, the failed retries at stop), each a burst per window
    windows = 1 + int((time.monotonic() - t_start) // DEFAULT_WINDOW_S)
    assert log.count("Traceback") <= 2 * DEFAULT_BURST * windows and len(log) < 1_000_000, log[-3000:]


def test_binds_beyond_loopback_warn_at_start(make_server: ServerFactory) -> None:
    srv = make_server("--host", "0.0.0.0", "--http-host", "0.0.0.0")
    log = srv.output()
    for setting, what in (("host", "the data plane (ZMQ)"), ("http_host", "the HTTP sidecar")):
        line = (
            f"WARNING kvwarden: {setting}=0.0.0.0 binds beyond loopback: any host that can reach "
            f"this address can speak to {what}; see docs/security.md"
        )
        assert line in log, log
    assert httpx.get(f"http://127.0.0.1:{srv.http_port}/livez", timeout=5.0).status_code == 200


def write_token(path: Path, mode: int) -> Path:
    path.write_text(TOKEN + "\n")
    path.chmod(mode)
    return path


def test_admin_token_file_end_to_end_with_kvwarden_reap(
    make_server: ServerFactory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    token_file = write_token(tmp_path / "admin-token", 0o600)
    srv = make_server("--admin-token-file", str(token_file), "--chunk-size", CHUNK)
    assert TOKEN not in Path(f"/proc/{srv.proc.pid}/cmdline").read_text()
    url = f"http://127.0.0.1:{srv.http_port}"
    w = WorkerAdapter(srv.endpoint, model_name="reaped", heartbeat_interval=10.0, request_timeout=10.0)
    try:
        w.register_kv_caches(allocate_kv_caches(*LAYOUT, dtype=torch.bfloat16))
        assert httpx.get(f"{url}/instances/{w.instance_id}", timeout=5.0).status_code == 200
        monkeypatch.setenv("KVWARDEN_ADMIN_TOKEN", "not-the-token")  # set after the server started
        assert main(["reap", str(w.instance_id), "--url", url]) == EXIT_UNAUTHORISED
        assert "unauthorised (wrong token)" in capsys.readouterr().err
        wrong = {"Authorization": "Bearer not-the-token"}
        with httpx.Client(base_url=url, headers=wrong, timeout=5.0) as c:
            for _ in range(REFUSED - 1):  # a flood of refused calls: their audit lines are rate-limited
                assert c.post(f"/instances/{w.instance_id}/reap").status_code == 401
        monkeypatch.setenv("KVWARDEN_ADMIN_TOKEN", TOKEN)
        assert main(["reap", str(w.instance_id), "--url", url]) == EXIT_OK
        assert f"instance {w.instance_id} reaped" in capsys.readouterr().out
        assert httpx.get(f"{url}/instances/{w.instance_id}", timeout=5.0).status_code == 404
    finally:
        w.close()
    assert srv.stop() == 0
    log = srv.output()
    audit = [ln for ln in log.splitlines() if "app.api.audit" in ln]
    assert len([ln for ln in audit if "outcome=401" in ln]) == DEFAULT_BURST, log
    assert len([ln for ln in audit if "outcome=200" in ln and "who=admin (token ok)" in ln]) == 1, log
    # reported when the window ended (the serve loop looks twice a second) or, at the latest, at exit
    assert (
        len(
            [
                ln
                for ln in audit
                if f"suppressed {REFUSED - DEFAULT_BURST} similar messages: audit: admin" in ln
            ]
        )
        == 1
    )
    assert "Traceback" not in log, log


@pytest.mark.parametrize("mode", [0o644, 0o640])
def test_admin_token_file_open_to_others_is_refused_at_start(
    make_server: ServerFactory, tmp_path: Path, mode: int
) -> None:
    token_file = write_token(tmp_path / "admin-token", mode)
    srv = make_server("--admin-token-file", str(token_file), ready=False)
    assert srv.proc.wait(60) == EXIT_USAGE
    err = srv.stderr_path.read_text()
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"kvwarden serve: invalid setting: admin_token_file: {token_file}: mode {mode:04o}"
    ), err
    assert "owner only (chmod 600)" in err
    assert srv.stdout_path.read_text() == ""
