"""A network namespace whose loopback is shaped to a link's rate, for the benchmarks that weigh
bytes against time on the wire (`kvwarden bench codec --link-gbit`).

Inside it, a redis-server and its reader talk over the namespace's own 127.0.0.1, as on one
host, but every byte passes a token bucket (``tc qdisc ... tbf``) at the rate asked for: what a
Redis on another host behind a link of that rate costs, without leaving this machine. Needs
root and iproute2's ``ip`` and ``tc``; `shaped_loopback` says what is missing otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


def unavailable() -> str | None:
    """Why a shaped namespace cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    missing = [p for p in ("ip", "tc") if shutil.which(p) is None]
    return f"needs {' and '.join(missing)} (Debian: iproute2)" if missing else None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


@contextlib.contextmanager
def shaped_loopback(gbit: float) -> Iterator[list[str]]:
    """A namespace whose loopback carries ``gbit`` Gbit/s at most, for the time of the block;
    yields the argv prefix that runs a command inside it."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"a shaped link {why}")
    if not 0 < gbit <= 400:
        raise ValueError(f"a link of {gbit} Gbit/s: between 0 and 400")
    name = f"kvwarden-bench-{os.getpid()}"
    _run("ip", "netns", "add", name)
    try:
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        # burst: 1 ms at the rate (a few of loopback's 64 KiB frames at the least)
        burst = max(256 << 10, int(gbit * 1e9 / 8 / 1000))
        _run(
            "ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
            "rate", f"{gbit}gbit", "burst", str(burst), "latency", "20ms",
        )  # fmt: skip
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
