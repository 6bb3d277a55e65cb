"""The tables of `kvwarden bench fs` and `kvwarden bench events` (`kvbench.report` shows them)."""

from __future__ import annotations

from typing import Any

from kvbench.tables import Table, _x


def fs_tables(rep: dict[str, Any]) -> list[Table]:
    fs, mib, x = rep["filesystem"], rep["chunk_bytes"] / (1 << 20), rep["ratios"]
    s, fr, wm = rep["store_ms"], rep["fresh_ms"], rep["warm_ms"]
    direct = rep["direct_io"] if fr["direct_read"] is None else f"{fr['direct_read']:.1f}"
    rows = [
        ["STORE, no file tier", f"{s['without_fs']:.1f}", ""],
        ["STORE, file tier on (ratio: on / off)", f"{s['with_fs']:.1f}", _x(rep["store_ratio"])],
        ["fresh: buffered read of the file", f"{fr['buffered_read']:.1f}", ""],
        ["fresh: O_DIRECT read of the file", direct, ""],
        ["fresh: RETRIEVE, disk -> L1 -> worker", f"{fr['retrieve']:.1f}", _x(x["fresh"])],
        ["fresh: RETRIEVE vs the O_DIRECT read", "", _x(x["direct"])],
        ["warm: buffered read of the file", f"{wm['buffered_read']:.1f}", ""],
        ["warm: RETRIEVE, page cache -> L1 -> worker", f"{wm['retrieve']:.1f}", _x(x["warm"])],
        ["warm: its checked copy alone, no request", f"{wm['checked_copy']:.1f}", _x(x["warm_floor"])],
    ]
    r = rep["restart"]
    restart = [
        [
            "empty directory" if name == "empty" else f"{r['files']:,} chunk files",
            f"{r[name]['first_ping_s']:.3f}",
            f"{r[name]['registered_s']:.3f}",
            f"{r[name]['first_retrieve_s']:.3f} ({'miss' if name == 'empty' else 'hit'})",
            f"{r[name]['rebuild_seconds']:.3f}",
            f"{r[name]['files']:,}",
        ]
        for name in ("empty", "many")
    ]
    restart.append(["files / empty", _x(r["ping_ratio"]), "", "", "", ""])
    return [
        Table(
            f"The file tier on {fs['type']} ({fs['device']}), {mib:g} MiB chunks, "
            f"{rep['params'].get('chunks_per_request', 1)} a request, fresh servers "
            "(median ms; ratio: plain read time / RETRIEVE time)",
            ["figure", "ms", "ratio"],
            rows,
        ),
        Table(
            f"Restart: from server start (median of {len(r['many']['runs'])} starts each, s)",
            ["fs directory", "first PING", "REGISTER", "first RETRIEVE", "index rebuilt", "files indexed"],
            restart,
        ),
    ]


def events_tables(rep: dict[str, Any]) -> list[Table]:
    mib, s, b, lk = rep["chunk_bytes"] / (1 << 20), rep["store_ms"], rep["burst"], rep["lookup"]
    first = rep["first_store"]
    rows = [
        ["STORE, events off (median ms)", f"{s['off']:.2f}", ""],
        [
            "STORE, events on, a subscriber reading (median ms; on / off)",
            f"{s['on']:.2f}",
            _x(rep["store_ratio"]),
        ],
        ["first STORE of a fresh server, off / on (ms)", f"{first['off_ms']:.1f} / {first['on_ms']:.1f}", ""],
        [f"burst: {b['stores']:,} STOREs, STOREs/s", f"{b['stores_per_s']:,.0f}", ""],
        ["burst: events published per s (BlockStored + BlockRemoved)", f"{b['events_per_s']:,.0f}", ""],
        [
            "burst: events dropped / subscriber's sequence gaps",
            f"{b['dropped']:.0f} / {b['received_gaps']}",
            "",
        ],
        [f"/v1/lookup: batch of {rep['params']['batch']} prompts (median ms)", f"{lk['batch_ms']:.1f}", ""],
        ["/v1/lookup: prompts/s (one client)", f"{lk['prompts_per_s']:,.0f}", ""],
    ]
    return [
        Table(
            f"KV events and /v1/lookup, {mib:g} MiB chunks, fresh servers", ["figure", "value", "ratio"], rows
        )
    ]
