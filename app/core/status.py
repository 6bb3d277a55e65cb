"""The `/status` document and the instance views, built from the data plane's locked accessors.

Nothing here holds a data-plane lock: each accessor takes its module's leaf lock, copies, and
lets go; the document is assembled from those copies afterwards. The result is a plain dict of
the `app.models.StatusPublic` shape, encoded directly (no per-instance model validation); the
instance list is encoded by `InstanceEncoder`, which reads only what changed since an instance
registered, so `/status` stays within its budget with 10,000 tracked instances. Builds go through a
`app.core.coalesce.Coalescer` (one at a time, shared, bounded duty cycle).
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from app.core.health import HealthChecker, HealthReport

if TYPE_CHECKING:
    from dataplane.server.facade import CheckResult, ContextEntry, DataPlaneView, L1Stats, SpaceState

# Building the document is pure Python, and a thread waiting for the GIL gets it only after the
# switch interval (0.5 ms in `serve`) unless the holder lets go: PING, answered on the loop thread,
# takes the GIL several times. So the builder hands it over every so many instances: 512 is
# ~0.5 ms of building. Each handover is a `time.sleep(0)`, which costs ~55 us (the kernel's timer
# slack) even when no thread waits: every 128 instances, that was half of a build at 10,000.
# (`os.sched_yield` costs 0.3 us but hands nothing over: this thread takes the GIL straight back
# before a waiter on another core has woken up.)
_YIELD_EVERY = 512


def instance_view(e: ContextEntry, now: float) -> dict[str, Any]:
    return {
        "instance_id": e.instance_id,
        "transfer_mode": e.transfer_mode,
        "memory": e.memory,
        "model_name": e.model_name,
        "world_size": e.world_size,
        "worker_id": e.worker_id,
        "registered_seconds_ago": round(max(0.0, now - e.registered_at), 3),
        "last_seen_seconds_ago": round(max(0.0, now - e.last_seen), 3),
        "has_liveness_signal": e.has_liveness_signal,
        "disconnected": e.disconnected,
    }


def find_instance(dp: DataPlaneView, instance_id: int) -> dict[str, Any] | None:
    e = dp.context_entry(instance_id)
    return None if e is None else instance_view(e, dp.clock())


def health_summary(dp: DataPlaneView, report: HealthReport) -> dict[str, Any]:
    return {
        "fallback_policy": str(dp.settings.fallback_policy.value),
        "checks": [check_view(r) for r in report.results],
        "bypassed_backends": list(report.bypassed_backends),
    }


def check_view(r: CheckResult) -> dict[str, Any]:
    """One check's result as `/health` and `/status` show it (`app.models.CheckPublic`)."""
    return {"name": r.name, "status": r.status, "component_type": r.component_type, "output": r.output}


def status_document(dp: DataPlaneView, report: HealthReport) -> dict[str, Any]:
    """The document without its instances: see `encode_status`."""
    info = dp.server_info()
    l1 = dp.l1_stats()
    doc: dict[str, Any] = {
        "server": {
            "server_id": info.server_id,
            "boot_token": info.boot_token,
            "version": info.version,
            "uptime_seconds": max(0.0, time.time() - info.started_at),
            "zmq_endpoint": info.endpoint,
            "chunk_size": info.chunk_size,
        },
        "is_healthy": report.is_healthy,
        "worker_liveness": asdict(dp.liveness_status()),
        "instances": None,  # placeholder, filled by encode_status
        "storage": {
            "l1": {
                "used_bytes": l1.used_bytes,
                "capacity_bytes": l1.capacity_bytes,
                "chunks": l1.chunks,
                "hot_cache": l1.hot_cache,
                "policy": l1.policy,
                "hits": l1.hits,
                "evictions": l1.evictions,
                "evictions_by_reason": l1.evictions_by_reason(),
                "arena": arena_view(l1),
                "tenant_share_bytes": l1.tenant_share_bytes,
                "tenants": [asdict(t) for t in l1.tenants or ()],
            },
            "fs": fs_view(dp),
            "remote": remote_view(dp),
        },
        "health": health_summary(dp, report),
    }
    return doc


def fs_view(dp: DataPlaneView) -> dict[str, Any] | None:
    s = dp.fs_state()
    if s is None:
        return None
    bypassed = "fs" in dp.monitor_state().bypassed_backends
    return {
        "path": s.root,
        "bypassed": bypassed,
        "capacity_bytes": s.capacity_bytes,
        "policy": s.policy,
        "used_bytes": s.used_bytes,
        "files": s.files,
        "rebuilt": s.rebuilt,
        "rebuild_seconds": s.rebuild_seconds,
        "hits": s.hits,
        "misses": s.misses,
        "bad_files": sum(s.bad_files.values()),
        "get_failures": sum(s.get_failures.values()),
        "read_ahead": s.read_ahead,
        "read_in_place": s.read_in_place,
        "promoted": s.promoted,
        "puts": s.puts,
        "coded_puts": s.coded_puts,
        "coded_bytes_saved": s.coded_bytes_saved,
        "put_failures": sum(s.put_failures.values()),
        "evictions": s.evictions,
        "queue_depth": s.queue_depth,
        "queue_bytes": s.queue_bytes,
        "dropped_writes": sum(s.drops.values()),
        "stalled_seconds": s.stalled_seconds,
        "ping_latency_seconds": s.ping_latency_s,
        "ping_error_code": s.ping_code,
        "space": space_view(s.space),
    }


def remote_view(dp: DataPlaneView) -> dict[str, Any] | None:
    r = dp.remote_state()
    if r is None:
        return None
    return {
        "url": r.url,
        "bypassed": r.bypassed,
        "ping_latency_seconds": r.ping_latency_seconds,
        "ping_error_code": r.ping_error_code,
        "hits": r.hits,
        "misses": r.misses,
        "bad_values": r.bad_values,
        "get_failures": r.get_failures,
        "puts": r.puts,
        "coded_puts": r.coded_puts,
        "coded_bytes_saved": r.coded_bytes_saved,
        "put_failures": r.put_failures,
        "queue_depth": r.queue_depth,
        "queue_bytes": r.queue_bytes,
        "dropped_writes": r.dropped_writes,
        "space": space_view(r.space),
    }


def space_view(s: SpaceState) -> dict[str, Any]:
    return {
        "out_of_space": s.out_of_space,
        "reason": s.reason,
        "seconds": round(s.seconds, 3),
        "episodes": s.episodes,
        "dropped_writes": s.dropped,
    }


def arena_view(l1: L1Stats) -> dict[str, Any] | None:
    a = l1.arena
    if a is None:
        return None
    return {
        "backing": a.backing,
        "faulted_bytes": a.faulted_bytes,
        "ready": a.ready,
        "huge_page_bytes": a.huge_page_bytes,
        "fragmentation": l1.fragmentation,
    }


class InstanceEncoder:
    """Encodes the instance list of `/status` straight to JSON, one instance at a time.

    What is fixed at registration (id, mode, memory, model, world size, rank) is encoded once
    per instance, read through `context_entry` the first time the instance is seen, and kept
    here keyed by (id, registered_at); each build then reads only what changes
    (`liveness_rows`) and formats it. That is ~4x less work than copying full entries, building
    a dict per instance and encoding the list (24 ms at 10,000 instances on this machine's
    cores), so /status stays within its budget and the data-plane loop, which shares the GIL,
    waits less. Not thread-safe: the `Coalescer` runs one build at a time.
    """

    def __init__(self) -> None:
        self._heads: dict[int, tuple[float, bytes]] = {}  # id -> (registered_at, b'{...,')

    def encode(self, dp: DataPlaneView) -> bytes:
        rows = dp.liveness_rows()
        now = dp.clock()
        heads = self._heads
        parts: list[bytes] = []
        for start in range(0, len(rows), _YIELD_EVERY):
            time.sleep(0)  # hand the GIL over: the data-plane loop shares this process
            # the slice's rows are formatted by one '%' (`_rows_format`): one call, not one per
            # row; '%.3f' (milliseconds, as `instance_view` rounds them) formats in half the
            # time '%r' (shortest round trip) takes, the biggest single cost of a build
            args: list[bytes | float] = []
            put = args.extend
            for iid, registered_at, last_seen, signal, disconnected in rows[start : start + _YIELD_EVERY]:
                cached = heads.get(iid)
                if cached is None or cached[0] != registered_at:
                    e = dp.context_entry(iid)
                    if e is None or e.registered_at != registered_at:
                        continue  # released (or replaced) since the rows were read
                    cached = heads[iid] = (registered_at, _head(e))
                age, idle = now - registered_at, now - last_seen
                put(
                    (
                        cached[1],
                        age if age > 0 else 0.0,
                        idle if idle > 0 else 0.0,
                        _TAILS[signal, disconnected],
                    )
                )
            if args:
                parts.append(_rows_format(len(args) // 4) % tuple(args))
        if len(heads) > len(rows) + _PRUNE_SLACK:  # instances gone: forget them
            live = {r[0] for r in rows}
            self._heads = {k: v for k, v in heads.items() if k in live}
        return b"[" + b",".join(parts) + b"]"


_ROW = b'%s"registered_seconds_ago":%.3f,"last_seen_seconds_ago":%.3f%s'


@functools.lru_cache(maxsize=16)
def _rows_format(n: int) -> bytes:
    """The format of ``n`` rows, comma-separated: (head, age, idle, tail) per row."""
    return b",".join([_ROW] * n)


_TAILS = {
    (signal, disconnected): b',"has_liveness_signal":%s,"disconnected":%s}'
    % (b"true" if signal else b"false", b"true" if disconnected else b"false")
    for signal in (True, False)
    for disconnected in (True, False)
}
_PRUNE_SLACK = 1024


def _head(e: ContextEntry) -> bytes:
    """The fixed fields of an instance as the start of its JSON object: ``{"instance_id":...,``."""
    fixed = {k: v for k, v in instance_view(e, e.registered_at).items() if k not in _CHANGING}
    return to_json(fixed)[:-1] + b","


_CHANGING = ("registered_seconds_ago", "last_seen_seconds_ago", "has_liveness_signal", "disconnected")


def encode_status(doc: dict[str, Any], instances_json: bytes) -> bytes:
    """The document with the (already encoded) instance list spliced in."""
    head = to_json(doc)
    marker = b'"instances":null'
    i = head.index(marker)
    return head[:i] + b'"instances":' + instances_json + head[i + len(marker) :]


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    """One build of the status document, encoded: what `/status` and `/instances` serve."""

    status_json: bytes
    instances_json: bytes


def build_snapshot(dp: DataPlaneView, health: HealthChecker, encoder: InstanceEncoder) -> StatusSnapshot:
    instances_json = encoder.encode(dp)
    doc = status_document(dp, health.run())
    return StatusSnapshot(encode_status(doc, instances_json), instances_json)
