"""`kvwarden bench`: placeholder."""
from __future__ import annotations
import argparse
def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.set_defaults(func=lambda ns: 0)
