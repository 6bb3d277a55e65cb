"""`kvwarden bench`: the project's own benchmarks, each beside same-run baselines.

`transfer` (STORE / RETRIEVE vs memcpy, raw ZMQ and Redis), `ping` (PING vs a raw ZMQ echo,
idle and under STORE load), `reaper` (a reap cycle with 100,000 tracked instances, PING
meanwhile); `procs` holds the process helpers they share (free ports, starting and stopping a
server). Each starts its own processes and stops them; nothing here runs inside `kvwarden serve`.
"""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    from dataplane.bench import ping, reaper, transfer

    sub = p.add_subparsers(dest="bench", required=True)
    transfer.add_args(sub)
    ping.add_args(sub)
    reaper.add_args(sub)
