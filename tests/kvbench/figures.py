"""What a report of each benchmark must hold: every figure, checked by key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kvbench.results import newest
from kvbench.transfer import MODES, PHASES

LAT = {"n", "p50_us", "p99_us"}
MS = {"n", "p50", "p99"}


def report(directory: Path, name: str) -> dict[str, Any]:
    path = newest(directory, name)
    assert path is not None, (
        f"no {name}-*.json under {directory}: {sorted(p.name for p in directory.iterdir())}"
    )
    rep: dict[str, Any] = json.loads(path.read_text())
    assert rep["benchmark"] == name
    assert {"date", "tier", "machine", "params"} <= rep.keys()
    return rep


def check_transfer(rep: dict[str, Any]) -> None:
    rows = rep["rows"]
    sizes = {r["chunk_tokens"] for r in rows}
    cprs = {r["chunks_per_request"] for r in rows}
    redis = shutil.which("redis-server") is not None
    for mode in MODES:
        for phase in PHASES:
            for size in sizes:
                for cpr in cprs:
                    match = [
                        r
                        for r in rows
                        if (r["mode"], r["phase"], r["chunk_tokens"], r["chunks_per_request"])
                        == (mode, phase, size, cpr)
                    ]
                    assert len(match) == 1, (mode, phase, size, cpr)
                    _check_row(match[0], phase == "warm", redis, rep["params"]["device"] == "cpu")


def _check_row(r: dict[str, Any], warm: bool, redis: bool, cpu: bool) -> None:
    gbps = {"memcpy", "store", "retrieve"}
    ratios = {"store_vs_memcpy", "retrieve_vs_memcpy"}
    if cpu and r["phase"] != "starting":  # the copy floor (not while the arena faults in)
        gbps |= {"gather", "scatter"}
        ratios |= {"store_vs_gather", "retrieve_vs_scatter"}
    if warm:
        gbps |= {"zmq"}
        ratios |= {"store_vs_zmq", "retrieve_vs_zmq"}
        if redis:
            gbps |= {"redis_set", "redis_get"}
            ratios |= {"store_vs_redis_set", "retrieve_vs_redis_get"}
    else:
        assert {"backing", "faulted_bytes", "ready"} <= r["arena"].keys()
    assert set(r["gbps"]) == gbps, r["gbps"]
    assert set(r["ratios"]) == ratios, r["ratios"]
    assert all(v > 0 for v in [*r["gbps"].values(), *r["ratios"].values()])
    assert r["rounds"] >= 1 and r["chunk_bytes"] > 0


def check_ping(rep: dict[str, Any]) -> None:
    for key in ("raw_zmq", "ping_idle", "ping_loaded"):
        assert set(rep[key]) == LAT and rep[key]["n"] > 0
    assert set(rep["ratios"]) == {"ping_idle_p99_vs_raw_p99", "ping_idle_p50_vs_raw_p50"}


def check_reaper(rep: dict[str, Any]) -> None:
    assert len(rep["runs"]) >= 2
    for run in rep["runs"]:
        assert run["instances"] > 0 and run["cycle_ms"]["n"] > 0
        assert {"stale", "p50", "max"} <= run["cycle_ms"].keys()
        assert set(run["ping_idle"]) == LAT and set(run["ping_during_cycles"]) == LAT


def check_http(rep: dict[str, Any]) -> None:
    load, large = rep["load"], rep["large"]
    for key in ("ping_idle", "ping_with_status", "ping_idle_again"):
        assert set(load[key]) == LAT
    assert load["status_ms"].keys() >= MS and load["status_ms"]["n"] > 0 and load["ratio_p99"] > 0
    for key in ("ping_idle", "ping_during_http", "ping_idle_again", "ping_during_spin"):
        assert set(large[key]) == LAT
    for key in ("status_ms", "metrics_ms"):
        assert set(large[key]) == MS and large[key]["n"] > 0
    assert large["instances"] > load["instances"] > 1 and large["ratio_p99"] > 0
    assert large["ratio_p99_spin"] > 0


def check_startup(rep: dict[str, Any]) -> None:
    waited = rep["params"]["arena_ready"] == "wait"
    assert rep["first_ping_s"] > 0
    assert rep["python_s"] > 0 and rep["import_torch_s"] > 0
    keys = ("memory_at_first_ping", "memory_arena_ready") if waited else ("memory_at_first_ping",)
    for run in rep["runs"]:
        for key in keys:
            assert {"rss_bytes", "rss_anon_bytes", "rss_shmem_bytes", "shm_bytes"} <= run[key].keys()
        if waited:
            assert run["first_ping_s"] <= run["arena_ready_s"]
            assert run["memory_arena_ready"]["shm_bytes"] > 0  # the arena's segment
            assert run["arena"]["ready"]
        else:  # --quick: stopped once the first PING was answered and memory read
            assert run["arena_ready_s"] is None and run["memory_arena_ready"] is None


def check_remote(rep: dict[str, Any]) -> None:
    assert rep["chunk_bytes"] > 0 and rep["store_ratio"] > 0 and rep["retrieve_ratio"] > 0
    n = rep["params"]["samples"]
    assert all(len(v) == n and min(v) > 0 for v in rep["samples_ms"].values())


def check_blend(rep: dict[str, Any]) -> None:
    assert rep["chunk_bytes"] > 0 and {r["mode"] for r in rep["rows"]} == {"server_driven", "engine_driven"}
    for r in rep["rows"]:
        assert set(r["ms"]) == {"memcpy", "retrieve", "blend_retrieve", "store", "blend_store"}
        assert all(v > 0 for v in [*r["ms"].values(), *r["ratios"].values()])
        assert all(len(v) == rep["params"]["rounds"] for v in r["samples_ms"].values())
        f = r["first"]
        assert f["blend_store_ms"] > 0 and f["blend_retrieve_ms"] > 0
        assert f["kernel_at_first_store"] in ("compiling", "ready")


def check_fs(rep: dict[str, Any]) -> None:
    n = rep["params"]["samples"]
    assert rep["chunk_bytes"] > 0 and rep["file_bytes"] > rep["chunk_bytes"]
    assert {"type", "device", "mount"} <= rep["filesystem"].keys()
    assert rep["store_ratio"] > 0 and min(rep["store_ms"].values()) > 0
    assert rep["ratios"]["fresh"] > 0 and rep["ratios"]["warm"] > 0
    for when in ("fresh", "warm"):
        assert rep[f"{when}_ms"]["retrieve"] > 0 and rep[f"{when}_ms"]["buffered_read"] > 0
        assert len(rep["samples_ms"][f"{when}_retrieve"]) == n
    floor = rep["warm_ms"]["checked_copy"]  # the tier's checked copy, in the benchmark's process
    assert floor > 0 and len(rep["samples_ms"]["warm_checked_copy"]) == n and rep["ratios"]["warm_floor"] > 0
    direct = rep["fresh_ms"]["direct_read"]
    if rep["direct_io"] == "supported":
        assert direct > 0 and rep["ratios"]["direct"] > 0 and len(rep["samples_ms"]["fresh_direct_read"]) == n
    else:
        assert direct is None and rep["ratios"]["direct"] is None
        assert rep["direct_io"].startswith("not supported")
    assert rep["server_fs"]["hits"] >= 2 * n  # every RETRIEVE was served from disk
    r = rep["restart"]
    assert r["many"]["files"] == r["files"] > 0 and r["empty"]["files"] == 0
    assert r["ping_ratio"] > 0 and r["fill_s"] > 0
    for name in ("empty", "many"):
        assert len(r[name]["runs"]) == rep["params"]["rounds"]
        assert 0 < r[name]["first_ping_s"] <= r[name]["registered_s"] <= r[name]["first_retrieve_s"]
        assert r[name]["rebuild_seconds"] >= 0 and r[name]["rebuilt_s"] > 0


def check_events(rep: dict[str, Any]) -> None:
    assert rep["chunk_bytes"] > 0 and rep["store_ratio"] > 0 and min(rep["store_ms"].values()) > 0
    b = rep["burst"]
    assert b["stores"] == rep["params"]["burst"] and b["events"] >= b["stores"] and b["events_per_s"] > 0
    assert b["dropped"] == 0 and b["received_gaps"] == 0 and b["received_batches"] > 0
    lk = rep["lookup"]
    assert lk["batch_ms"] > 0 and lk["prompts_per_s"] > 0
    assert lk["prompts_held"] == rep["params"]["batch"] // 2  # the half stored, found by the lookup


def check_codec(rep: dict[str, Any]) -> None:
    k = rep["kinds"]["random_weight_kind"]
    assert k["bytes"] > 0 and k["memcpy_gbs"] > 0 and 1 < k["entropy_bound"] < 2
    assert set(k["codecs"]) == {"planes", "planes_numpy_passes", "blosc2_zstd_shuffle", "blosc2_lz4_shuffle"}
    assert k["codecs"]["planes_numpy_passes"]["ratio"] == k["codecs"]["planes"]["ratio"]  # (the same bytes)
    assert rep["kernels_ready_s"] > 0 and rep["redis_links"] == {}  # (no --link-gbit: no namespace)
    for c in k["codecs"].values():
        assert c["ratio"] > 1 and c["encode_gbs"] > 0 and c["decode_gbs"] > 0
    assert k["codecs"]["planes"]["ratio"] > 1.3  # (KV-like bf16 codes to about 1.45x, any size)
    q = rep["int8"]["random_weight_kind"]
    assert 1.9 < q["ratio"] < 2 and q["encode_gbs"] > 0 and q["decode_gbs"] > 0
    assert 0 < q["rms_error_k"] < 0.01 and 0 < q["rms_error_v"] < 0.01  # (a step of 1/255 of a range)
    r = rep["redis"]
    assert r["lossless"]["stored_bytes"] < r["none"]["stored_bytes"] and r["coded_over_raw_time"] > 0


CHECKS = {
    "blend": check_blend,
    "codec": check_codec,
    "events": check_events,
    "remote": check_remote,
    "transfer": check_transfer,
    "ping": check_ping,
    "reaper": check_reaper,
    "http": check_http,
    "startup": check_startup,
}
