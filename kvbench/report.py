"""Reports of `kvwarden bench` as tables: printed as aligned text by the benchmarks, written as
Markdown by ``scripts/plot_bench.py``. Ratios come first; absolute figures after them."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from kvbench.report_tiers import events_tables, fs_tables
from kvbench.tables import Table as Table
from kvbench.tables import _x
from kvbench.targets import verdicts


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _us(lat: dict[str, float]) -> list[str]:
    return [f"{lat['p50_us']:.0f}", f"{lat['p99_us']:.0f}"]


def _where(r: dict[str, Any]) -> list[str]:
    mib = r["chunk_bytes"] / (1 << 20)
    return [
        r["mode"].replace("_", "-"),
        r["phase"],
        f"{r['chunk_tokens']} ({mib:g} MiB)",
        str(r["chunks_per_request"]),
    ]


_WHERE = ["mode", "phase", "chunk tokens", "chunks/req"]


def transfer_tables(rep: dict[str, Any]) -> list[Table]:
    rows = rep["rows"]
    ratio_keys = [
        "store_vs_memcpy",
        "retrieve_vs_memcpy",
        "store_vs_gather",
        "retrieve_vs_scatter",
        "store_vs_zmq",
        "retrieve_vs_zmq",
        "store_vs_redis_set",
        "retrieve_vs_redis_get",
    ]
    names = [
        "STORE/memcpy",
        "RETRIEVE/memcpy",
        "STORE/gather",
        "RETRIEVE/scatter",
        "STORE/ZMQ",
        "RETRIEVE/ZMQ",
        "STORE/Redis SET",
        "RETRIEVE/Redis GET",
    ]
    ratios = Table(
        f"STORE / RETRIEVE vs same-run baselines (medians of {rep['params']['rounds']} interleaved rounds)",
        _WHERE + names,
        [_where(r) + [_x(r["ratios"].get(k)) for k in ratio_keys] for r in rows],
    )
    gb_keys = ["store", "retrieve", "memcpy", "gather", "scatter", "zmq", "redis_set", "redis_get"]
    gbps = Table(
        "Throughput, GB/s (medians; starting and fresh rows: also the very first request's)",
        [
            *_WHERE,
            "STORE",
            "RETRIEVE",
            "memcpy",
            "gather",
            "scatter",
            "ZMQ",
            "Redis SET",
            "Redis GET",
            "1st STORE",
            "1st RETRIEVE",
        ],
        [
            _where(r)
            + [_gb(r["gbps"].get(k)) for k in gb_keys]
            + [_gb(r.get("first_gbps", {}).get(k)) for k in ("store", "retrieve")]
            for r in rows
        ],
    )
    return [ratios, gbps]


def ping_tables(rep: dict[str, Any]) -> list[Table]:
    r = rep["ratios"]
    storers = rep["params"]["storers"]
    return [
        Table(
            "PING round trip through the server vs a raw ZMQ echo (us)",
            ["figure", "p50", "p99", "p99 / raw p99"],
            [
                ["raw ZMQ echo", *_us(rep["raw_zmq"]), "1.00x"],
                ["PING, idle", *_us(rep["ping_idle"]), _x(r["ping_idle_p99_vs_raw_p99"])],
                [
                    f"PING, {storers} workers storing",
                    *_us(rep["ping_loaded"]),
                    _x(rep["ping_loaded"]["p99_us"] / rep["raw_zmq"]["p99_us"]),
                ],
            ],
        )
    ]


def reaper_tables(rep: dict[str, Any]) -> list[Table]:
    rows = []
    for run in rep["runs"]:
        c = run["cycle_ms"]
        rows.append(
            [
                f"{run['instances']:,}",
                f"{c['stale']:,}",
                f"{c['p50']:.1f}",
                f"{c['max']:.1f}",
                *_us(run["ping_idle"]),
                *_us(run["ping_during_cycles"]),
            ]
        )
    header = ["tracked", "stale/cycle", "cycle p50 ms", "cycle max ms", "PING idle p50 us", "p99 us"]
    return [
        Table("Reap cycles (1% stale) and PING meanwhile", [*header, "PING during p50 us", "p99 us"], rows)
    ]


def http_tables(rep: dict[str, Any]) -> list[Table]:
    out = []
    large = rep.get("large")
    if large:
        rows = [
            [f"/{k}", f"{large[k + '_ms']['p50']:.1f}", f"{large[k + '_ms']['p99']:.1f}"]
            for k in ("status", "metrics")
        ]
        rows.append(["PING idle (us)", *_us(large["ping_idle"])])
        rows.append(["PING during /status+/metrics (us)", *_us(large["ping_during_http"])])
        rows.append(["PING p99 during / idle", "", _x(large["ratio_p99"])])
        if "ping_during_spin" in large:  # the yardstick: two cores busy, no request sent
            rows.append(["PING while 2 processes spin (us)", *_us(large["ping_during_spin"])])
            rows.append(["PING p99 spinning / idle (machine floor)", "", _x(large["ratio_p99_spin"])])
        out.append(
            Table(
                f"HTTP sidecar with {large['instances']:,} tracked instances (ms)",
                ["figure", "p50", "p99"],
                rows,
            )
        )
    load = rep.get("load")
    if load:
        rows = [
            ["PING idle (us)", *_us(load["ping_idle"])],
            [f"PING with {load['rate']:g} /status per s (us)", *_us(load["ping_with_status"])],
            ["PING idle again (us)", *_us(load["ping_idle_again"])],
            [
                "/status during the load (ms)",
                f"{load['status_ms']['p50']:.1f}",
                f"{load['status_ms']['p99']:.1f}",
            ],
            ["PING p99 loaded / idle (worse idle block)", "", _x(load["ratio_p99"])],
        ]
        out.append(
            Table(
                f"PING under /status load, {load['instances']:,} tracked instances",
                ["figure", "p50", "p99"],
                rows,
            )
        )
    return out


def startup_tables(rep: dict[str, Any]) -> list[Table]:
    rows = []
    for i, run in enumerate(rep["runs"]):
        a, b, ready = run["memory_at_first_ping"], run["memory_arena_ready"], run["arena_ready_s"]
        rows.append(
            [
                str(i + 1),
                f"{run['first_ping_s']:.2f}",
                "not waited for" if ready is None else f"{ready:.2f}",
                _rss_shm(a),
                "-" if b is None else _rss_shm(b),
            ]
        )
    gb = rep["params"]["l1_size_gb"]
    header = [
        "run",
        "first PING s",
        "arena ready s",
        "RSS / shm MiB at first PING",
        "RSS / shm MiB arena ready",
    ]
    t = Table(f"Server start with a {gb:g} GiB L1", header, rows)
    anchor = Table(
        "Same-run anchors (median s)",
        ["python -c pass", "python -c 'import torch'", "first PING"],
        [[f"{rep['python_s']:.2f}", f"{rep['import_torch_s']:.2f}", f"{rep['first_ping_s']:.2f}"]],
    )
    return [t, anchor]


def _rss_shm(mem: dict[str, int]) -> str:
    return f"{mem['rss_bytes'] / (1 << 20):.0f} / {mem['shm_bytes'] / (1 << 20):.0f}"


def remote_tables(rep: dict[str, Any]) -> list[Table]:
    mib = rep["chunk_bytes"] / (1 << 20)
    s, rows = rep["store_ms"], []
    rows.append(["STORE, no remote tier (ms)", f"{s['without_remote']:.1f}", ""])
    rows.append(["STORE, Redis configured (ms)", f"{s['with_remote']:.1f}", _x(rep["store_ratio"])])
    rows.append(["redis-py GET of the value (ms)", f"{rep['redis_get_ms']:.1f}", ""])
    rows.append(
        [
            "remote RETRIEVE, Redis -> L1 -> worker (ms)",
            f"{rep['retrieve_ms']:.1f}",
            _x(rep["retrieve_ratio"]),
        ]
    )
    return [
        Table(
            f"The Redis tier, {mib:.1f} MiB chunks, fresh servers (medians)",
            ["figure", "time", "ratio"],
            rows,
        )
    ]


def blend_tables(rep: dict[str, Any]) -> list[Table]:
    mib = rep["chunk_bytes"] / (1 << 20)
    rows, first = [], []
    for r in rep["rows"]:
        mode, ms, x = r["mode"].replace("_", "-"), r["ms"], r["ratios"]
        rows.append([f"{mode} RETRIEVE", f"{ms['retrieve']:.1f}", f"{ms['blend_retrieve']:.1f}"])
        rows[-1].append(_x(x["blend_retrieve_vs_retrieve"]))
        rows.append([f"{mode} STORE", f"{ms['store']:.1f}", f"{ms['blend_store']:.1f}"])
        rows[-1].append(_x(x["blend_store_vs_store"]))
        f = r["first"]
        first.append(
            [
                mode,
                f"{f['blend_store_ms']:.1f} ({f['kernel_at_first_store']})",
                f"{f['blend_retrieve_ms']:.1f} ({f['kernel_at_first_retrieve']})",
                "ready" if f.get("worker_kernels_at_first_store") else "compiling",
            ]
        )
    memcpy = statistics.median(r["ms"]["memcpy"] for r in rep["rows"])
    return [
        Table(
            f"Blend vs plain, one {mib:g} MiB chunk a request, kernels ready "
            f"(median ms; memcpy {memcpy:.1f})",
            ["operation", "plain ms", "blend ms", "blend / plain"],
            rows,
        ),
        Table(
            "The first blend requests after BLEND_REGISTER on a fresh server (ms; the server's kernels then)",
            ["mode", "first BLEND_STORE", "first BLEND_RETRIEVE", "worker's kernels"],
            first,
        ),
    ]


TABLES: dict[str, Callable[[dict[str, Any]], list[Table]]] = {
    "events": events_tables,
    "blend": blend_tables,
    "fs": fs_tables,
    "remote": remote_tables,
    "transfer": transfer_tables,
    "ping": ping_tables,
    "reaper": reaper_tables,
    "http": http_tables,
    "startup": startup_tables,
}


def verdict_table(reports: dict[str, dict[str, Any]], miss: str = "NO") -> Table:
    rows = []
    for v in verdicts(reports):
        shown = f"{v.measured:.2f}"
        if (float(shown) >= v.bound) != (v.measured >= v.bound):  # rounding would hide the verdict
            shown = f"{v.measured:.3f}"
        measured = f"{shown}x" if v.unit == "x" else f"{float(shown):.3g} {v.unit}"
        rows.append([v.figure, measured, v.target, "yes" if v.ok else miss])
    return Table("Targets", ["figure", "measured", "target", "met"], rows)


def noise_table(reports: dict[str, dict[str, Any]]) -> Table:
    rows = []
    for name, rep in reports.items():
        n = rep.get("noise")
        if n:
            load = " / ".join(f"{v:.1f}" for v in n["loadavg_at_end"])
            share = f"{100 * n['other_cpu_share']:.0f}%"
            rows.append([name, rep["date"], f"{n['wall_s']:.0f}", share, f"{n['steal_s']:.1f}", load])
    header = ["benchmark", "started", "wall s", "CPU used by other processes", "steal s", "load avg at end"]
    return Table("Machine noise during each benchmark", header, rows)


def text(t: Table) -> str:
    cells = [t.header, *t.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(t.header))]
    lines = [t.title]
    for row in cells:
        lines.append(
            "  "
            + "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return "\n".join(lines)


def markdown(t: Table) -> str:
    lines = [
        f"**{t.title}**",
        "",
        "| " + " | ".join(t.header) + " |",
        "|" + "|".join(["---"] * len(t.header)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in t.rows]
    return "\n".join(lines)


def show(name: str) -> Callable[[dict[str, Any]], None]:
    """What a benchmark prints: its target verdicts first, then its tables."""

    def print_all(rep: dict[str, Any]) -> None:
        v = verdict_table({name: rep})
        blocks = ([text(v)] if v.rows else []) + [text(t) for t in TABLES[name](rep)]
        print("\n\n".join(blocks), flush=True)

    return print_all


print_transfer = show("transfer")
