"""`kvwarden bench all`: every benchmark in turn, with the same ``--quick`` / ``--tiny`` /
``--json``; then the targets of all of them in one table."""

from __future__ import annotations

import argparse
import sys
import time
from types import ModuleType
from typing import Any

from kvbench.results import add_output_args

ORDER = ("startup", "transfer", "ping", "reaper", "http", "remote", "blend", "events", "codec")


def modules() -> dict[str, ModuleType]:
    from kvbench import (
        blend,
        codec,
        events,
        fs,
        handoff,
        ping,
        quality,
        reaper,
        remote,
        serve,
        sidecar,
        startup,
        trace,
        transfer,
        vllm,
    )

    return {
        "startup": startup,
        "transfer": transfer,
        "ping": ping,
        "reaper": reaper,
        "http": sidecar,
        "remote": remote,
        "fs": fs,
        "events": events,
        "blend": blend,
        "codec": codec,
        "vllm": vllm,
        "handoff": handoff,
        "quality": quality,
        "serve": serve,
        "trace": trace,
    }


def add_args(sub: Any) -> None:
    p = sub.add_parser("all", help="every benchmark in turn (--quick: under two minutes on 2 cores)")
    p.add_argument("--only", default=",".join(ORDER), help="benchmarks to run, comma-separated")
    add_output_args(p)
    p.set_defaults(func=run_all)


def run_all(ns: argparse.Namespace) -> int:
    names = [n.strip() for n in str(ns.only).split(",") if n.strip()]
    unknown = set(names) - set(ORDER)
    if not names or unknown:
        print(f"bench: --only takes some of {','.join(ORDER)}", file=sys.stderr)
        return 2
    flags = [f for f, on in (("--quick", ns.quick), ("--tiny", ns.tiny), ("--json", ns.json)) if on]
    flags += ["--results-dir", str(ns.results_dir)]
    t0 = time.monotonic()
    for name in names:
        print(f"\n== kvwarden bench {name} {' '.join(flags)}", flush=True)
        parser = argparse.ArgumentParser(prog=f"kvwarden bench {name}")
        modules()[name].add_args(parser.add_subparsers())
        sub_ns = parser.parse_args([name, *flags])
        rc = int(sub_ns.func(sub_ns))
        if rc:
            return rc
    print(f"\n== all done in {time.monotonic() - t0:.0f} s", flush=True)
    return 0
