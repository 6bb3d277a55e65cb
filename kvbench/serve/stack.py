"""The configurations `kvwarden bench serve` compares, and the processes each one starts.

Each configuration (`Config`) is a vLLM OpenAI server (run as the module
``vllm.entrypoints.openai.api_server``: the CPU build's ``vllm`` command looks for a distribution
named ``vllm``), started fresh for each protocol, with its own prefix cache on and
``kv_gb`` GiB of KV space, and for kvwarden's rows a ``kvwarden serve`` started just before it
with default settings but for its tier sizes (and a throwaway ``redis-server`` or a file-tier
directory). `Stack` starts them, waits for them with deadlines, and stops them all.

Each of those processes runs in a session of its own, apart from the benchmark's client, as
separate services would. Linux's autogroup scheduler (on by default) shares the CPU between
sessions first: with kvwarden and Redis in the client's session, a Redis load on a 2-core host
that vLLM keeps busy left that one share to three processes; the load took about a second
instead of 0.2-0.3 s, and the client read a decoding stream's tokens (made every 9 ms) in one
burst 0.6-0.9 s late, a stall of the measurement and not of vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.movers import start_redis
from kvbench.procs import BenchServer, bench_env, free_port, launch, stop_process, wait_http, wait_ready

CPU_BLOCK = 128  # tokens a block of vLLM's CPU KV cache
SERVED_NAME = "bench"
# kvwarden's counters a report keeps (where its hits came from)
KEPT_METRICS = (
    "kvwarden_remote_hits",
    "kvwarden_remote_gets",
    "kvwarden_remote_read_ahead",
    "kvwarden_remote_puts",
    "kvwarden_fs_",
    "kvwarden_l1_hits",
    "kvwarden_prefetches",
    "kvwarden_hit_tokens",
    "kvwarden_lookup_tokens",
)
VLLM_START_S = 600.0


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    kv_gb: int | None  # vLLM's KV space (GiB); None: room for every prompt of the protocol
    kvwarden: tuple[str, ...] | None = None  # `kvwarden serve` flags; None: no connector
    tier: str = ""  # "fs" or "redis": the lower tier kvwarden's row adds


CONFIGS: tuple[Config, ...] = (
    Config("ideal", "vLLM's own prefix cache, room for everything (the ideal)", None),
    Config("vllm", "vLLM's own prefix cache alone", 1),
    Config("l1", "+ kvwarden, L1 4 GiB", 1, ("--l1-size-gb", "4")),
    Config("fs", "+ kvwarden, L1 0.4 GiB + file tier", 1, ("--l1-size-gb", "0.4"), "fs"),
    Config("redis", "+ kvwarden, L1 0.4 GiB + Redis on loopback", 1, ("--l1-size-gb", "0.4"), "redis"),
)
BY_KEY = {c.key: c for c in CONFIGS}


class Stack:
    """The processes of one configuration, started on enter and stopped on exit. ``url`` is
    vLLM's OpenAI server; ``started_s`` the seconds from the first start to vLLM answering."""

    def __init__(
        self,
        config: Config,
        python: str,
        model: Path,
        work: Path,
        kv_gb: int,
        reserved_cpus: int,
        dtype: str = "float32",
        engine_blocks: int | None = None,
        small_l1_gb: float | None = None,
        kvwarden_flags: tuple[str, ...] = (),
    ) -> None:
        """``engine_blocks``: cap vLLM's KV blocks (``--num-gpu-blocks-override``) in the rows
        whose engine cache is meant to be too small (``kv_gb`` set): a tiny model's KV would fit
        in any GiB. ``small_l1_gb``: L1's size in the rows with a lower tier (0.4 GiB), for the
        same reason. ``kvwarden_flags``: more `kvwarden serve` flags (a run off the defaults)."""
        self.config = config
        self.python = python
        self.model = model
        self.work = work
        self.kv_gb = kv_gb
        self.reserved_cpus = reserved_cpus
        self.dtype = dtype
        self.engine_blocks = engine_blocks if config.kv_gb is not None else None
        self.small_l1_gb = small_l1_gb
        self.kvwarden_flags = kvwarden_flags
        self.url = ""
        self.started_s = 0.0
        self.log = work / f"vllm-{config.key}.log"
        self._stack = contextlib.ExitStack()
        self.kvwarden: BenchServer | None = None

    def __enter__(self) -> Stack:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        t0 = time.perf_counter()
        connector = self._start_kvwarden()
        port = free_port()
        cmd = self._vllm_command(port)
        if connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(connector)]
        root = str(Path(__file__).resolve().parents[2])
        env = {
            **bench_env(),
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_gb),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(self.reserved_cpus),
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        with open(self.log, "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True
            )
        self._stack.callback(stop_process, proc, 60.0)
        self.url = f"http://127.0.0.1:{port}"
        _wait_vllm(proc, self.url, self.log, VLLM_START_S)
        self.started_s = time.perf_counter() - t0

    def _start_kvwarden(self) -> dict[str, Any] | None:
        """The kvwarden server of a kvwarden row (and its Redis or directory), started; the
        ``--kv-transfer-config`` that points vLLM at it (None: no kvwarden in this row)."""
        c = self.config
        connector: dict[str, Any] | None = None
        if c.kvwarden is not None:
            flags = [*c.kvwarden]
            if c.tier and self.small_l1_gb is not None:
                flags += ["--l1-size-gb", str(self.small_l1_gb)]  # (the last one given wins)
            if c.tier == "redis":
                pair = start_redis(own_session=True)
                if pair is None:
                    raise RuntimeError("redis-server is not installed (make tools)")
                proc, raw = pair
                self._stack.callback(proc.wait)  # (callbacks run last first)
                self._stack.callback(proc.kill)
                self._stack.callback(raw.close)
                flags += [
                    "--remote-url",
                    f"redis://127.0.0.1:{raw.connection_pool.connection_kwargs['port']}/0",
                ]
            elif c.tier == "fs":
                d = tempfile.mkdtemp(prefix="kvwarden-bench-fs-", dir=self.work)
                flags += ["--fs-path", d, "--fs-size-gb", "8"]
            server = launch(*flags, *self.kvwarden_flags, own_session=True)
            self._stack.callback(server.stop)
            wait_http(server)
            self.kvwarden = server
            connector = {
                "kv_connector": "KVWardenConnector",
                "kv_connector_module_path": "dataplane.client.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvwarden.url": server.endpoint},
            }
        return connector

    def _vllm_command(self, port: int) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--enforce-eager",  # as the vLLM tests and `bench vllm` run it (no compile at start)
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--disable-log-stats",
        ]
        if self.engine_blocks is not None:  # (a request must fit: the model length shrinks to match)
            cmd += ["--num-gpu-blocks-override", str(self.engine_blocks)]
            cmd += ["--max-model-len", str((self.engine_blocks - 1) * CPU_BLOCK)]  # (one block is vLLM's own)
        return cmd

    def metrics(self) -> dict[str, float]:
        """kvwarden's counters that say where hits came from (empty without kvwarden)."""
        if self.kvwarden is None:
            return {}
        text = self.kvwarden.get("/metrics").decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, _, value = line.rpartition(" ")
            if name.split("{")[0].endswith("_total") and name.startswith(KEPT_METRICS):
                with contextlib.suppress(ValueError):
                    out[name] = float(value)
        return out


def _wait_vllm(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float) -> None:
    def health() -> None:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            if r.status != 200:
                raise RuntimeError(f"/health answered {r.status}")

    try:
        wait_ready(health, proc, timeout_s)
    except RuntimeError as exc:
        raise RuntimeError(f"vLLM's server: {exc}:\n{_tail(log)}") from exc


def _tail(log: Path) -> str:
    """The lines of ``log`` that name an error (the root cause comes before the traceback of
    the engine's failed start), then its end."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    errors = [line for line in text.splitlines() if "Error" in line or "error:" in line][:20]
    return "\n".join(errors) + "\n...\n" + text[-3000:]
