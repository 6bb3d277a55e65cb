"""What every benchmark shares: the ``--quick`` / ``--tiny`` / ``--json`` flags, sizes chosen by
tier, percentiles, a description of the machine, and writing a report under ``bench/results``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESULTS_DIR = Path("bench/results")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer samples and smaller sets (every figure still reported): the whole suite in under "
        "two minutes on a 2-core machine; explicit flags win",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a plumbing check (the smoke test): the smallest sizes that still report every figure; "
        "the numbers mean nothing",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="also write the report to RESULTS_DIR/<benchmark>-<timestamp>.json and print its path",
    )
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help=f"default {RESULTS_DIR}")


def tier(ns: argparse.Namespace) -> str:
    return "tiny" if ns.tiny else "quick" if ns.quick else "full"


def resolve(ns: argparse.Namespace, **values: tuple[Any, Any, Any]) -> None:
    """Each flag left unset (None) takes its (full, quick, tiny) value for ``ns``'s tier. Called
    first by every benchmark: it also notes the CPU clocks the noise figure starts from."""
    ns.cpu_at_start = _cpu_clocks()
    i = {"full": 0, "quick": 1, "tiny": 2}[tier(ns)]
    for name, by_tier in values.items():
        if getattr(ns, name, None) is None:
            setattr(ns, name, by_tier[i])


def int_list(text: str, what: str) -> list[int]:
    """``"1,4"`` -> [1, 4]; ValueError naming ``what`` unless every item is a positive integer."""
    try:
        out = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ValueError(f"{what} takes positive integers separated by commas, got {text!r}")
    return out


def latency(xs: Sequence[float]) -> dict[str, float]:
    """p50 and p99 of round trips given in seconds, in microseconds; and how many."""
    a = np.asarray(xs, dtype=float) * 1e6
    return {"n": len(xs), "p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99))}


def machine() -> dict[str, Any]:
    """What ran the benchmark: cores, CPU model, memory, kernel, Python and torch versions."""
    import torch

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        mem_kib = 0
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu": model,
        "memory_gib": round(mem_kib / (1 << 20), 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def source() -> dict[str, Any]:
    """The commit the measured code is at, and whether its tree had changes (when it is a git
    checkout); the benchmarks run the code of the working tree."""
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        st = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    if rev.returncode or st.returncode:
        return {}
    return {"commit": rev.stdout.strip(), "modified_files": len(st.stdout.splitlines())}


def _cpu_clocks() -> tuple[float, float, float, float]:
    """(wall clock, CPU seconds every core was busy, stolen by the hypervisor, spent by this
    process and its waited-for children)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return time.monotonic(), (user + nice + system + irq + softirq) / hz, steal / hz, own


def noise(ns: argparse.Namespace) -> dict[str, Any]:
    """What else used the machine while the benchmark ran: CPU time no process of ours spent
    (other sessions, the kernel), as a share of all cores over the run; hypervisor steal."""
    start = getattr(ns, "cpu_at_start", None) or _cpu_clocks()
    end = _cpu_clocks()
    wall, busy, steal, own = (b - a for a, b in zip(start, end, strict=True))
    other = max(0.0, busy - own)
    cores = len(os.sched_getaffinity(0))
    return {
        "wall_s": wall,
        "own_cpu_s": own,
        "other_cpu_s": other,
        "other_cpu_share": other / max(wall * cores, 1e-9),
        "steal_s": steal,
        "loadavg_at_end": list(os.getloadavg()),
    }


def finish(
    ns: argparse.Namespace, name: str, report: dict[str, Any], show: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Stamp ``report`` (benchmark, tier, date, machine), ``show`` it and, with ``--json``, write
    it to ``<results-dir>/<name>-<timestamp>.json`` and print the path."""
    stamped = {
        "benchmark": name,
        "tier": tier(ns),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "noise": noise(ns),
        "source": source(),
        **report,
    }
    show(stamped)
    n = stamped["noise"]
    print(
        f"{name}: {n['wall_s']:.0f} s; other processes used {100 * n['other_cpu_share']:.0f}% of the "
        f"machine meanwhile, hypervisor steal {n['steal_s']:.1f} s",
        flush=True,
    )
    if ns.json:
        print(f"results: {write(ns.results_dir, name, stamped)}", flush=True)
    return stamped


def write(directory: Path, name: str, report: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = directory / f"{name}-{stamp}.json"
    n = 1
    while path.exists():
        path = directory / f"{name}-{stamp}-{n}.json"
        n += 1
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def newest(directory: Path, name: str) -> Path | None:
    """The newest ``<name>-*.json`` under ``directory`` (by the timestamp in its name)."""
    found = sorted(
        directory.glob(f"{name}-*.json"), key=lambda p: (p.stem[len(name) + 1 :], p.stat().st_mtime)
    )
    return found[-1] if found else None
