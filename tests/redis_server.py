"""A real ``redis-server`` for tests: started on a free loopback port (never a machine-wide
Redis), and stopped, paused (SIGSTOP: a hang), resumed, killed (SIGKILL: a crash) or restarted
on the same port by the test."""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import redis

from tests.helpers import free_port, wait_until


class RedisServer:
    def __init__(self, port: int | None = None, extra: Sequence[str] = (), cwd: Path | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:  # `make test` installs it (Makefile: REQUIRED_PROGRAMS)
            raise RuntimeError("redis-server is not installed: run `make tools`")
        self.exe = exe
        self.port = port or free_port()
        self.extra = list(extra)
        self.cwd = cwd
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
            [self.exe, *args, *self.extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.cwd
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


class RedisClusterServers:
    """A Redis Cluster of ``masters`` masters (no replicas) on free loopback ports, built with
    ``redis-cli --cluster create``; its files under ``workdir``."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(masters):
                port = free_port()
                # the cluster bus on a free port of its own (port + 10,000 may be past 65,535)
                extra = [
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"nodes-{port}.conf",
                    "--cluster-port",
                    str(free_port()),
                ]
                self.nodes.append(RedisServer(port, extra, cwd=workdir))
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            cli = shutil.which("redis-cli")
            if cli is None:
                raise RuntimeError("redis-cli is not installed: run `make tools`")
            subprocess.run(
                [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=60,
            )
            wait_until(self._ok, 30, what="the cluster to agree on its slots")
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def _ok(self) -> bool:
        for n in self.nodes:
            c = n.client(2.0)
            try:
                if c.execute_command("CLUSTER INFO").get("cluster_state") != "ok":  # (parsed to a dict)
                    return False
            finally:
                c.close()
        return True

    def keys(self, pattern: str) -> list[bytes]:
        out: list[bytes] = []
        for n in self.nodes:
            c = n.client()
            try:
                out += c.keys(pattern)
            finally:
                c.close()
        return out

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
