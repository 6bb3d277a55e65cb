"""`kvwarden bench`: the project's own benchmarks, each beside same-run baselines.

`transfer` (STORE / RETRIEVE vs memcpy, raw ZMQ and Redis; both transfer modes; starting, fresh
and warm), `blend` (BLEND_STORE / BLEND_RETRIEVE vs plain STORE / RETRIEVE, first requests and
kernels ready), `ping` (PING vs a raw ZMQ echo, idle and under STORE load), `reaper` (reap
cycles with up to 100,000 tracked instances, PING meanwhile), `http` (`/status` and `/metrics`
with 10,000 tracked instances, PING under `/status` load), `remote` (the Redis tier beside
redis-py), `fs` (the file tier: RETRIEVE from disk beside plain reads of the same files, STORE
with and without it, restart with 100,000 chunk files), `startup` (server start to first PING,
its memory), `all` (every one of those in turn) and `vllm` (time to first token of real vLLM
engines, with and without kvwarden; not in `all`) and `serve` (vLLM's OpenAI server under load,
long-document QA and multi-round chat; not in `all`). Each takes ``--quick`` (the whole suite in
under two minutes on 2 cores), ``--tiny`` (a plumbing check) and ``--json`` (the report written
under ``bench/results``). `procs` and `bulk` hold the process helpers they share, `movers` the
transfer samplers, `results`, `targets` and `report` the output. Each benchmark starts its own
processes and stops them; nothing here runs inside `kvwarden serve`, and neither the data plane
nor the sidecar imports this package (only the `kvwarden bench` command does).
"""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    from kvbench import suite

    sub = p.add_subparsers(dest="bench", required=True)
    for module in suite.modules().values():
        module.add_args(sub)
    suite.add_args(sub)
