"""The `/status` document and the instance views, built from the data plane's locked accessors.

Nothing here holds a data-plane lock: each accessor takes its module's leaf lock, copies, and
lets go; the document is assembled from those copies afterwards. The result is a plain dict of
the `app.models.StatusPublic` shape, encoded directly (no per-instance model validation), so
`/status` stays within its budget with 10,000 tracked instances. Builds go through a
`app.core.coalesce.Coalescer` (one at a time, shared, bounded duty cycle).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json

from app.core.health import HealthChecker, HealthReport

if TYPE_CHECKING:
    from dataplane.server.facade import ContextEntry, DataPlaneView, L1Stats

# encode the instance list in slices: one encoder call holds the GIL throughout, and the
# data-plane loop shares this process; slices give it a chance to run between them
_ENCODE_SLICE = 256
# Building the document is pure Python, and a thread waiting for the GIL gets it only after the
# switch interval (0.5 ms in `serve`) unless the holder lets go: PING, answered on the loop thread,
# takes the GIL several times. So the builder hands it over every so many instances.
_YIELD_EVERY = 128


def instance_view(e: ContextEntry, now: float) -> dict[str, Any]:
    return {
        "instance_id": e.instance_id,
        "transfer_mode": e.transfer_mode,
        "memory": e.memory,
        "model_name": e.model_name,
        "world_size": e.world_size,
        "worker_id": e.worker_id,
        "registered_seconds_ago": max(0.0, now - e.registered_at),
        "last_seen_seconds_ago": max(0.0, now - e.last_seen),
        "has_liveness_signal": e.has_liveness_signal,
        "disconnected": e.disconnected,
    }


def iter_instances(dp: DataPlaneView) -> Iterator[dict[str, Any]]:
    entries = dp.context_entries_snapshot()  # copies, each taken under its module's lock
    now = dp.clock()
    for i, e in enumerate(entries):
        if not i % _YIELD_EVERY:
            time.sleep(0)  # hand the GIL over: the data-plane loop shares this process
        yield instance_view(e, now)


def find_instance(dp: DataPlaneView, instance_id: int) -> dict[str, Any] | None:
    e = dp.context_entry(instance_id)
    return None if e is None else instance_view(e, dp.clock())


def health_summary(dp: DataPlaneView, report: HealthReport) -> dict[str, Any]:
    return {
        "fallback_policy": str(dp.settings.fallback_policy.value),
        "checks": [check_view(r) for r in report.results],
        "bypassed_backends": list(report.bypassed_backends),
    }


def check_view(r: Any) -> dict[str, Any]:
    return {"name": r.name, "status": r.status, "component_type": r.component_type, "output": r.output}


def status_document(dp: DataPlaneView, report: HealthReport) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the document without its instances, the instances): see `encode_status`."""
    instances = list(iter_instances(dp))
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
                "arena": arena_view(l1),
            },
            "remote": None,
        },
        "health": health_summary(dp, report),
    }
    return doc, instances


def arena_view(l1: L1Stats) -> dict[str, Any] | None:
    a = l1.arena
    if a is None:
        return None
    return {"backing": a.backing, "faulted_bytes": a.faulted_bytes, "ready": a.ready,
            "huge_page_bytes": a.huge_page_bytes, "fragmentation": l1.fragmentation}  # fmt: skip


def encode_instances(instances: list[dict[str, Any]]) -> bytes:
    # pydantic-core's encoder: about 5x json.dumps on this shape (floats dominate)
    parts = []
    for i in range(0, len(instances), _ENCODE_SLICE):
        parts.append(to_json(instances[i : i + _ENCODE_SLICE])[1:-1])
        time.sleep(0)  # the encoder holds the GIL for a whole slice: hand it over between
    return b"[" + b",".join(parts) + b"]"


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


def build_snapshot(dp: DataPlaneView, health: HealthChecker) -> StatusSnapshot:
    doc, instances = status_document(dp, health.run())
    instances_json = encode_instances(instances)
    return StatusSnapshot(encode_status(doc, instances_json), instances_json)
