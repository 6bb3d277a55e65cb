"""A real ``redis-server`` for tests: started on a free loopback port (never a machine-wide
Redis), and stopped, paused (SIGSTOP: a hang), resumed, killed (SIGKILL: a crash) or restarted
on the same port by the test."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Sequence

import redis

from tests.helpers import free_port, wait_until


class RedisServer:
    def __init__(self, port: int | None = None, extra: Sequence[str] = ()) -> None:
        exe = shutil.which("redis-server")
        if exe is None:  # `make test` installs it (Makefile: REQUIRED_PROGRAMS)
            raise RuntimeError("redis-server is not installed: run `make tools`")
        self.exe = exe
        self.port = port or free_port()
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, timeout_s: float = 10.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s)

    def start(self) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(
            [self.exe, *args, *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        probe = self.client(1.0)
        try:
            wait_until(lambda: self._answers(probe), 10, what=f"redis-server on port {self.port}")
        finally:
            probe.close()

    def _answers(self, probe: redis.Redis) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
        try:
            return bool(probe.ping())
        except (redis.AuthenticationError, redis.ResponseError):
            return True  # it answered (NOAUTH: started with --requirepass)
        except redis.RedisError:
            return False

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
