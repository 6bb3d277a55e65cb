"""Process helpers the benchmarks share: free ports, a server process, stopping it."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(*args: str) -> list[str]:
    """``kvwarden serve`` with ``args``, run by this interpreter."""
    return [sys.executable, "-m", "app.cli", "serve", *args]


def start_server(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A ``kvwarden serve`` process on free ports; its ZMQ endpoint. Its standard output (the
    "serving on" line) is dropped, so a benchmark's own output stays clean (``--json``); its
    warnings and errors still reach standard error."""
    port, http_port = free_port(), free_port()
    cmd = serve_command("--port", str(port), "--http-port", str(http_port), "--log-level", "warning", *args)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL), f"tcp://127.0.0.1:{port}"


def wait_ready(probe: Callable[[], Any], proc: subprocess.Popen[Any], timeout_s: float) -> None:
    """Call ``probe`` until it returns without raising; RuntimeError when ``proc`` exits or the
    deadline passes first."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            probe()
            return
        except Exception:
            pause.wait(0.05)
    raise RuntimeError("server did not answer in time")


def wait_server(proc: subprocess.Popen[Any], endpoint: str, timeout_s: float = 60.0) -> None:
    """Until the server at ``endpoint`` answers HELLO."""
    from dataplane.client import WorkerAdapter

    def hello() -> None:
        w = WorkerAdapter(endpoint, "bench-probe", request_timeout=0.5)
        try:
            w.server_info()
        finally:
            w.close()

    wait_ready(hello, proc, timeout_s)


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 15.0) -> None:
    """SIGTERM (the server drains and exits), SIGKILL if it has not within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
