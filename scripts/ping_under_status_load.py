#!/usr/bin/env python3
"""PING round trip through a real `kvwarden serve`, idle and under `/status` load.

A thin wrapper: the measurement is the load phase of `kvwarden bench http` (its large phase
skipped). ``--instances`` tracked instances are registered, then PINGs (one every
``--ping-interval-ms``) are timed idle, while another process GETs `/status` ``--rate`` times a
second, and idle again; the figure is the loaded p99 over the worse idle p99 (target <= 1.5x).

    .venv/bin/python scripts/ping_under_status_load.py [--instances 1000] [--pings 2000] [--json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.cli import main as kvwarden  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=1000)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=50.0, help="/status requests per second")
    ap.add_argument("--ping-interval-ms", type=float, default=2.0)
    ap.add_argument("--json", action="store_true", help="also write the report under bench/results")
    ns = ap.parse_args()
    args = ["bench", "http", "--instances", "0", "--load-instances", str(ns.instances)]
    args += ["--pings", str(ns.pings), "--rate", str(ns.rate), "--ping-interval-ms", str(ns.ping_interval_ms)]
    return kvwarden([*args, *(["--json"] if ns.json else [])])


if __name__ == "__main__":
    sys.exit(main())
