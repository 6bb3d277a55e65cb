#!/usr/bin/env python3
"""Plot the newest `kvwarden bench` results and regenerate the results table of BENCHMARKS.md.

Reads the newest ``<benchmark>-*.json`` of each benchmark under ``--results-dir`` (written by
``kvwarden bench ... --json``). Writes the figure (STORE and RETRIEVE GB/s against chunk size,
both transfer modes, starting, fresh and warm, beside memcpy, ZMQ and Redis) to ``--out``, and replaces
what lies between ``<!-- table -->`` and ``<!-- /table -->`` in ``--markdown`` with the targets
and tables of those results (ratios first).

    .venv/bin/python scripts/plot_bench.py [--results-dir bench/results] \\
        [--out docs/bench-throughput.png] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvbench import report  # noqa: E402
from kvbench.results import RESULTS_DIR, newest  # noqa: E402

BENCHMARKS = ("transfer", "ping", "reaper", "http", "startup", "remote")
START, END = "<!-- table -->", "<!-- /table -->"
MODE_COLOURS = {"server_driven": "tab:blue", "engine_driven": "tab:orange"}
BASELINES = {  # key: (label, colour, line style)
    "memcpy": ("memcpy, 1 thread", "black", "-"),
    "gather": ("the same copy without a server (gather)", "tab:purple", "-."),
    "scatter": ("the same copy without a server (scatter)", "tab:purple", "-."),
    "zmq": ("the bytes over ZMQ", "tab:green", ":"),
    "redis_set": ("Redis SET", "tab:red", ":"),
    "redis_get": ("Redis GET", "tab:red", ":"),
}


def load(directory: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    out = {}
    for name in BENCHMARKS:
        path = newest(directory, name)
        if path is not None:
            out[name] = (path, json.loads(path.read_text()))
    return out


def _series(rows: list[dict[str, Any]], key: str, **match: Any) -> tuple[list[int], list[float]]:
    """Chunk sizes and the mean of ``gbps[key]`` over the rows that match (sorted by size)."""
    by_size: dict[int, list[float]] = {}
    for r in rows:
        if key in r["gbps"] and all(r[k] == v for k, v in match.items()):
            by_size.setdefault(r["chunk_tokens"], []).append(r["gbps"][key])
    sizes = sorted(by_size)
    return sizes, [sum(by_size[s]) / len(by_size[s]) for s in sizes]


def plot(rep: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rep["rows"]
    cprs = sorted({r["chunks_per_request"] for r in rows})
    fig, axes = plt.subplots(len(cprs), 2, figsize=(12, 4.2 * len(cprs)), squeeze=False, sharex=True)
    for i, cpr in enumerate(cprs):
        for j, (op, floor, other) in enumerate(
            (("store", "gather", "redis_set"), ("retrieve", "scatter", "redis_get"))
        ):
            _panel(axes[i][j], rows, op, floor, other, cpr)
    m = rep["machine"]
    fig.suptitle(
        f"kvwarden bench transfer, {rep['date'][:10]}, {m['cores']} cores ({m['cpu'] or 'unknown CPU'}); "
        "medians; baselines sampled in the same rounds",
        fontsize=10,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _panel(ax: Any, rows: list[dict[str, Any]], op: str, floor: str, other: str, cpr: int) -> None:
    for mode, colour in MODE_COLOURS.items():
        for phase, style in (("warm", "-"), ("fresh", "--"), ("starting", ":")):
            x, y = _series(rows, op, mode=mode, phase=phase, chunks_per_request=cpr)
            if x:
                ax.plot(
                    x,
                    y,
                    style,
                    color=colour,
                    marker="o",
                    label=f"{op.upper()} {mode.replace('_', '-')} {phase}",
                )
    for key in ("memcpy", floor, "zmq", other):
        x, y = _series(rows, key, phase="warm", chunks_per_request=cpr)
        if x:
            label, colour, style = BASELINES[key]
            ax.plot(x, y, style, color=colour, marker="s", label=label)
    x, y = _series(rows, "memcpy", phase="starting", chunks_per_request=cpr)
    if x:  # the starting rows' own denominator: memcpy sampled while the arena faulted in
        ax.plot(x, y, ":", color="grey", marker="s", label="memcpy, 1 thread, starting phase")
    ax.set_xscale("log", base=2)
    sizes = sorted({r["chunk_tokens"] for r in rows})
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("chunk size (tokens)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{op.upper()}, {cpr} chunk(s) per request", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def table(results: dict[str, tuple[Path, dict[str, Any]]]) -> str:
    reports = {name: rep for name, (_, rep) in results.items()}
    dates = sorted({rep["date"][:10] for rep in reports.values()})
    tiers = sorted({rep["tier"] for rep in reports.values()})
    m = next(iter(reports.values()))["machine"]
    machine = (
        f"{m['cores']} cores, {m['cpu'] or 'unknown CPU'}, {m['memory_gib']} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}, torch {m['torch']}"
    )
    files = ", ".join(f"`{path.name}`" for path, _ in results.values())
    commits = sorted({_commit(rep) for rep in reports.values()} - {""})
    code = f" Code at {' and '.join(commits)}." if commits else ""
    lines = [
        f"Measured {' and '.join(dates)} ({'/'.join(tiers)} run) on {machine}.{code} "
        f"Generated by `scripts/plot_bench.py` from {files}.",
        "",
        report.markdown(report.verdict_table(reports, miss="**NO**")),
    ]
    for name, rep in reports.items():
        for t in report.TABLES[name](rep):
            lines += ["", report.markdown(t)]
    lines += ["", report.markdown(report.noise_table(reports))]
    return "\n".join(lines)


def _commit(rep: dict[str, Any]) -> str:
    src = rep.get("source") or {}
    if not src.get("commit"):
        return ""
    n = src.get("modified_files", 0)
    return f"commit {src['commit']}" + (f" (with {n} files modified)" if n else "")


def splice(markdown: Path, body: str) -> None:
    text = markdown.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"plot_bench: {markdown} has no {START} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    markdown.write_text(f"{head}{START}\n{body}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--out", type=Path, default=Path("docs/bench-throughput.png"))
    ap.add_argument("--markdown", type=Path, default=Path("BENCHMARKS.md"))
    ns = ap.parse_args(argv)
    results = load(ns.results_dir)
    if not results:
        print(
            f"plot_bench: no results under {ns.results_dir} (run `kvwarden bench all --json`)",
            file=sys.stderr,
        )
        return 1
    if "transfer" in results:
        plot(results["transfer"][1], ns.out)
        print(f"plot_bench: wrote {ns.out}")
    splice(ns.markdown, table(results))
    print(f"plot_bench: regenerated the table in {ns.markdown} from {len(results)} benchmark(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
