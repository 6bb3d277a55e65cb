"""A worker process for the end-to-end tests, and the test-side handle that drives it.

Run as ``python -m tests.e2e.workers --endpoint ... --model ...``: it allocates a shared-memory
KV cache (random or zero), registers it, prints one JSON line ``{"ready": ...}``, then serves
JSON-line commands from stdin, answering each with one JSON line on stdout:

    {"op": "store", "tokens": [...], "blocks": [...]}        -> store_detail()
    {"op": "lookup", "tokens": [...]}                         -> {"hit": n}
    {"op": "retrieve", "tokens", "blocks", "out": path}       -> {"retrieved": n}; zeroes the
        blocks first, then writes the token-major bytes of the n retrieved tokens to ``out``
    {"op": "dump", "blocks": [...], "n": n, "out": path}      -> token-major bytes of n tokens
    {"op": "close"}                                           -> close the adapter and exit 0

Token-major bytes: per layer, K then V, the first n token slots of ``blocks`` in order;
the same for any block size or block placement, so two workers' bytes compare directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import ROOT, LineReader, subprocess_env

LAYOUT = {"layers": 4, "blocks": 64, "block_size": 16, "heads": 2, "head_dim": 8}


# ------------------------------------------------------------------------- worker side


def _token_major(caches: list[Any], blocks: list[int], n: int) -> bytes:
    import torch

    if n == 0:
        return b""
    idx = torch.tensor(blocks, dtype=torch.long)
    parts = []
    for c in caches:
        two, _, bs, h, d = c.shape
        parts.append(c.index_select(1, idx).reshape(two, len(blocks) * bs, h, d)[:, :n])
    return torch.stack(parts).contiguous().view(torch.uint8).numpy().tobytes()


def worker_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--model", default="m")
    ap.add_argument("--fill", choices=("random", "zero"), default="zero")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heartbeat", type=float, default=10.0)
    ap.add_argument("--request-timeout", type=float, default=20.0)
    args = ap.parse_args(argv)

    import torch

    from dataplane.client import WorkerAdapter, allocate_kv_caches

    caches = allocate_kv_caches(
        num_layers=LAYOUT["layers"],
        num_blocks=LAYOUT["blocks"],
        block_size=LAYOUT["block_size"],
        num_kv_heads=LAYOUT["heads"],
        head_dim=LAYOUT["head_dim"],
        dtype=torch.bfloat16,
    )
    if args.fill == "random":
        g = torch.Generator().manual_seed(args.seed)
        for c in caches:
            c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    w = WorkerAdapter(
        args.endpoint,
        model_name=args.model,
        heartbeat_interval=args.heartbeat,
        request_timeout=args.request_timeout,
    )
    w.register_kv_caches(caches)
    from dataplane.memory.shm import SHM_DIR

    segments = sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"kvwarden-{os.getpid()}-"))

    def say(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    say(
        {
            "ready": True,
            "instance_id": w.instance_id,
            "segments": segments,
            "chunk_size": w.chunk_size,
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "store":
            say(dataclasses.asdict(w.store_detail(cmd["tokens"], cmd["blocks"])))
        elif op == "lookup":
            say({"hit": w.lookup(cmd["tokens"])})
        elif op == "retrieve":
            for c in caches:
                c[:, cmd["blocks"]] = 0
            n = w.retrieve(cmd["tokens"], cmd["blocks"])
            Path(cmd["out"]).write_bytes(_token_major(caches, cmd["blocks"], n))
            say({"retrieved": n})
        elif op == "dump":
            Path(cmd["out"]).write_bytes(_token_major(caches, cmd["blocks"], cmd["n"]))
            say({"dumped": cmd["n"]})
        elif op == "close":
            w.close()
            say({"closed": True})
            return 0
        else:
            say({"error": f"unknown op {op}"})
    return 0


# --------------------------------------------------------------------------- test side


class WorkerProcess:
    """Starts a worker process (output to files under ``workdir``) and sends it commands."""

    def __init__(
        self,
        workdir: Path,
        endpoint: str,
        name: str,
        *,
        model: str = "m",
        fill: str = "zero",
        seed: int = 0,
        request_timeout: float = 20.0,
        env: dict[str, str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.workdir = workdir
        self.stderr_path = workdir / f"worker-{name}.err"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.e2e.workers",
                    "--endpoint",
                    endpoint,
                    "--model",
                    model,
                    "--fill",
                    fill,
                    "--seed",
                    str(seed),
                    "--request-timeout",
                    str(request_timeout),
                ],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env or subprocess_env(),
            )
        self._lines = LineReader(self.proc)
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 90.0) -> dict[str, Any]:
        self.info = self._read(timeout)
        assert self.info.get("ready"), self.info
        return self.info

    def _read(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.readline(timeout)
        except AssertionError as exc:
            raise AssertionError(f"worker {self.name}: {exc}\n{self.stderr()}") from None
        out: dict[str, Any] = json.loads(line)
        return out

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def cmd(self, op: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, **kw}) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read(timeout)
        assert "error" not in reply, reply
        return reply

    def store(self, tokens: list[int], blocks: list[int]) -> dict[str, int]:
        return self.cmd("store", tokens=tokens, blocks=blocks)

    def lookup(self, tokens: list[int]) -> int:
        return int(self.cmd("lookup", tokens=tokens)["hit"])

    def retrieve(self, tokens: list[int], blocks: list[int], out: Path) -> int:
        return int(self.cmd("retrieve", tokens=tokens, blocks=blocks, out=str(out))["retrieved"])

    def dump(self, blocks: list[int], n: int, out: Path) -> bytes:
        self.cmd("dump", blocks=blocks, n=n, out=str(out))
        return out.read_bytes()

    def close(self, timeout: float = 60.0) -> int:
        """Ask the worker to close its adapter and exit; returns its exit code."""
        self.cmd("close", timeout=timeout)
        rc = self.proc.wait(timeout)
        self._close_pipes()
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Teardown: kill if still running, reap, close pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._close_pipes()

    def _close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                f.close()


def token_bytes_per_token() -> int:
    return LAYOUT["layers"] * 2 * LAYOUT["heads"] * LAYOUT["head_dim"] * 2  # bfloat16


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
