"""Shared test helpers: polling with a deadline, real server processes, raw requests.

`free_port` is the benchmarks' (`kvbench.procs`), re-exported for the tests."""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import zmq

from dataplane.wire.messages import MsgType
from dataplane.wire.protocol import ReplyFrame, decode_reply, encode_request
from kvbench.procs import free_port

ROOT = Path(__file__).resolve().parent.parent


def wait_until(
    pred: Callable[[], Any], timeout: float, interval: float = 0.02, what: str = "condition"
) -> Any:
    """Poll ``pred`` until it returns a truthy value (returned) or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        pause.wait(interval)


class FakeClock:
    """An injected monotonic clock that moves only when a test says so."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def request(sock: zmq.Socket[Any], frames: bytes | Sequence[bytes], timeout: float = 10.0) -> list[bytes]:
    """Send one message (a frame or a multipart list) and return the reply's frames."""
    if isinstance(frames, bytes):
        sock.send(frames)
    else:
        sock.send_multipart(list(frames))
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        raise AssertionError(f"no reply within {timeout:g}s")
    return sock.recv_multipart()


def call(sock: zmq.Socket[Any], frame: bytes | Sequence[bytes], timeout: float = 10.0) -> ReplyFrame:
    """Send a request and decode the (last frame of the) reply."""
    return decode_reply(request(sock, frame, timeout)[-1])


def error_of(reply: ReplyFrame) -> tuple[str, str]:
    assert reply.ok is False, f"expected an error reply, got {reply}"
    assert isinstance(reply.body, dict), reply.body
    return str(reply.body["code"]), str(reply.body["message"])


_RID = iter(range(1000, 1 << 62))


def next_rid() -> int:
    return next(_RID)


def ping(
    sock: zmq.Socket[Any], instance_id: int | None = None, timeout: float = 10.0, secret: bytes = bytes(16)
) -> ReplyFrame:
    """A PING; with an id it carries ``secret`` (a wrong one answers ``tracked: false``)."""
    rid = next_rid()
    payload = [instance_id, None if instance_id is None else secret]
    reply = call(sock, encode_request(rid, MsgType.PING, payload), timeout)
    assert reply.ok, reply
    assert reply.request_id == rid
    assert isinstance(reply.body["boot_token"], int)
    return reply


def dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


class ServerProcess:
    """A real ``kvwarden serve`` process on free ports, its output in files under ``workdir``."""

    def __init__(
        self, workdir: Path, *args: str, env: dict[str, str] | None = None, port: int = 0, http_port: int = 0
    ) -> None:
        self.port = port or free_port()  # a given port: a restart where the last server was
        self.http_port = http_port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.stdout_path = workdir / f"server-{self.port}.out"
        self.stderr_path = workdir / f"server-{self.port}.err"
        cmd = [
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            *([] if "--ipc-path" in args else ["--port", str(self.port)]),  # one data-plane endpoint
            "--http-port",
            str(self.http_port),
            # a small L1 unless a test sizes it: its arena is reserved and faulted in at start
            *([] if "--l1-size-gb" in args else ["--l1-size-gb", "0.25"]),
            *args,
        ]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env=env or subprocess_env())

    def output(self) -> str:
        return self.stdout_path.read_text(errors="replace") + self.stderr_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Until the server answers HELLO (it does while it starts) and says it is serving (its
        data plane built, its HTTP sidecar up); returns its server info."""
        info = self._hello(timeout)
        wait_until(
            lambda: (
                "kvwarden serving on" in self.stdout_path.read_text(errors="replace")
                or self.proc.poll() is not None
            ),
            timeout,
            0.02,
            what="the server's 'serving on' line",
        )
        if self.proc.poll() is not None:
            raise AssertionError(
                f"server exited with {self.proc.returncode} while starting:\n" + self.output()
            )
        return info

    def _hello(self, timeout: float) -> dict[str, Any]:
        ctx: zmq.Context[Any] = zmq.Context()
        sock = dealer(ctx, self.endpoint)
        try:
            rid = next_rid()
            sock.send(encode_request(rid, MsgType.HELLO, []))
            deadline = time.monotonic() + timeout
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"server exited with {self.proc.returncode} before answering HELLO:\n" + self.output()
                    )
                if time.monotonic() >= deadline:
                    raise AssertionError(f"server did not answer HELLO in {timeout:g}s:\n" + self.output())
                if sock.poll(50, zmq.POLLIN):
                    reply = decode_reply(sock.recv())
                    assert reply.ok and reply.request_id == rid, reply
                    info: dict[str, Any] = reply.body
                    return info
        finally:
            sock.close(linger=0)
            ctx.term()

    def sigterm(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


class LineReader:
    """Reads newline-terminated lines from a subprocess pipe, each within a deadline."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.fd = proc.stdout.fileno()
        self.buf = b""

    def readline(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line from pid {self.proc.pid} within {timeout:g}s")
            ready, _, _ = select.select([self.fd], [], [], min(left, 0.5))
            if ready:
                data = os.read(self.fd, 65536)
                if not data:
                    raise AssertionError(f"pid {self.proc.pid} closed its output (exit {self.proc.poll()})")
                self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


@contextlib.contextmanager
def mounted_tmpfs(size: str) -> Iterator[Path]:
    """A fresh tmpfs of ``size`` on a temporary directory, unmounted after; the test is skipped
    when this process may not mount one (not root, or no mount(8))."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d = Path(tempfile.mkdtemp(prefix="kvw-tmpfs-"))
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(d)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except OSError as exc:
        r = subprocess.CompletedProcess([], 1, "", str(exc))
    if r.returncode:
        d.rmdir()
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        gc.collect()  # mappings of dead tensors go first, so the unmount is not busy
        if subprocess.run(["umount", str(d)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)
        d.rmdir()


def fill_filesystem(mount: Path, left: int) -> Path:
    """A file that takes all but ``left`` bytes of ``mount``'s free space (other data); remove
    it to free the space."""
    st = os.statvfs(mount)
    filler = mount / "other-data"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(1, st.f_bavail * st.f_frsize - left))
    finally:
        os.close(fd)
    return filler


def new_name() -> str:
    return f"kvwarden-{os.getpid()}-{secrets.token_hex(8)}"
