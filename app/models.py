"""Response models of the sidecar: the shapes of the external contract (docs: interfaces.md).

The models are the OpenAPI schema and the contract tests' yardstick. The hot routes
(`/status`, `/instances`) build plain dicts of exactly these shapes and encode them directly
(see `app.core.status`), because validating 10,000 instance objects on every request would
cost more than building them; `tests/app` validates their output against these models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app.lookup_models import MAX_ADAPTER_CHARS, MAX_SALT_CHARS

CheckStatus = Literal["pass", "warn", "fail"]
TransferModeName = Literal["server_driven", "engine_driven"]  # dataplane.wire.kinds.TransferMode
MemoryKindName = Literal["shm", "cuda_ipc"]  # dataplane.wire.kinds.MemoryKind


class Detail(BaseModel):
    """A plain message (errors and simple answers)."""

    detail: str


class LivezPublic(BaseModel):
    status: Literal["pass"] = "pass"


class CheckPublic(BaseModel):
    """One health check's latest result."""

    name: str = Field(description="component:measurement, e.g. dataplane:loop")
    status: CheckStatus
    component_type: str = Field("component", description="component, system or datastore")
    output: str = Field("", description="why the check is not passing; empty when it passes")


class HealthPublic(BaseModel):
    """`application/health+json` (draft-inadarei-api-health-check): status plus named checks."""

    status: CheckStatus
    version: str
    service_id: str
    description: str = "kvwarden data plane"
    output: str = Field("", description="the first failing check's output, if any")
    checks: dict[str, list[CheckPublic]] = Field(description="check name -> its results (one each here)")


class ServerPublic(BaseModel):
    server_id: str
    boot_token: int
    version: str
    uptime_seconds: float
    zmq_endpoint: str
    chunk_size: int


class WorkerLivenessPublic(BaseModel):
    enabled: bool
    reap_timeout_seconds: float
    registration_grace_seconds: float
    disconnect_grace_seconds: float
    tracked_instances: int
    reaped_total: int
    blend_instances: int = Field(0, description="instances holding blend state (their RoPE tables)")
    blend_kernel: str = Field(
        "idle",
        description="the compiled blend rotation: idle (no blend registration yet), compiling, ready, "
        "or 'unavailable: <why>' (blend transfers then rotate with torch, slower)",
    )


class InstancePublic(BaseModel):
    """One tracked worker instance."""

    instance_id: int
    transfer_mode: TransferModeName
    memory: MemoryKindName
    model_name: str
    world_size: int
    worker_id: int
    registered_seconds_ago: float
    last_seen_seconds_ago: float
    has_liveness_signal: bool
    disconnected: bool


class ArenaPublic(BaseModel):
    backing: Literal["shm", "private"] = Field(
        description="shm: a server-owned segment (shareable with workers); private: process memory"
    )
    faulted_bytes: int = Field(description="bytes of the arena faulted in at start so far")
    ready: bool = Field(description="the whole arena is reserved and faulted in")
    huge_page_bytes: int = Field(description="bytes in transparent huge pages (the process's)")
    fragmentation: float = Field(description="1 - largest free extent / free bytes (0: one piece)")


class TenantPublic(BaseModel):
    tenant: str = Field(
        description="a digest of the tenant's salt keyed by this server's start ('t-...'; the salt "
        "itself is never shown), 'unsalted' for requests without a salt, 'other' for the rest summed"
    )
    bytes: int = Field(description="bytes of L1 it holds (committed and reserved)")
    chunks: int
    hits: int = Field(description="its chunks served to its requests")
    evictions: int = Field(description="its chunks evicted")


class L1Public(BaseModel):
    used_bytes: int
    capacity_bytes: int
    chunks: int
    hot_cache: bool
    policy: str = Field(description="the eviction order (l1_eviction): lru or lfuda")
    hits: int = Field(
        description="chunks requests found in L1 (those a lower tier brought in for them are that "
        "tier's hits)"
    )
    evictions: int = Field(description="chunks evicted, for any reason")
    evictions_by_reason: dict[str, int] = Field(
        description="capacity: the next in l1_eviction's order, to make room; tenant_share: a tenant's own, "
        "to keep it within l1_tenant_share"
    )
    arena: ArenaPublic | None = Field(None, description="the region L1's buffers are carved from")
    tenant_share_bytes: int | None = Field(
        None,
        description="what one tenant may hold before its stores evict only its own chunks "
        "(l1_tenant_share); null: no shares",
    )
    tenants: list[TenantPublic] = Field(
        default_factory=list, description="the tenants holding most (at most 16), the rest as 'other'"
    )


class SpacePublic(BaseModel):
    """A lower tier's room for writes: out of space (a full disk, Redis answering OOM) is no
    outage. Its writes stop (dropped, counted), what it holds is still served, and its health
    check warns; writes resume once there is room again."""

    out_of_space: bool = Field(description="true while its writes are stopped for want of space")
    reason: str = Field(description="what refused the write that started it ('' while there is room)")
    seconds: float = Field(description="how long it has been out of space (0 while there is room)")
    episodes: int = Field(description="times it ran out of space since start")
    dropped_writes: int = Field(description="writes dropped for want of space in the current or last episode")


class RemotePublic(BaseModel):
    url: str = Field(description="the remote tier's URL, without its password")
    bypassed: bool
    ping_latency_seconds: float = Field(description="the last health PING's round trip")
    ping_error_code: int = Field(description="the last health PING: 0 ok, -1 timeout, -2 other error")
    hits: int = Field(description="chunks read from the remote tier")
    misses: int = Field(description="reads that found nothing usable (bad values included)")
    bad_values: int = Field(description="values refused: truncated, damaged, foreign, another key's")
    get_failures: int = Field(description="reads that failed: timeouts, connection, auth, errors")
    puts: int = Field(description="chunks written")
    coded_puts: int = Field(0, description="chunks written coded (remote_compression lossless)")
    coded_bytes_saved: int = Field(0, description="bytes coding saved against the chunks' raw size")
    put_failures: int
    queue_depth: int = Field(description="writes waiting in the write-behind queue")
    queue_bytes: int
    dropped_writes: int = Field(
        description="writes dropped: queue full, backend bypassed, shutdown, out of space"
    )
    space: SpacePublic = Field(description="room for writes (Redis answering OOM stops them)")


class FsPublic(BaseModel):
    path: str = Field(description="the file tier's directory")
    bypassed: bool = Field(description="true while the local_cpu fallback bypasses it")
    capacity_bytes: int = Field(description="fs_size_gb in bytes: the cap on its files")
    policy: str = Field(description="the eviction order (fs_eviction): lru or lfuda")
    used_bytes: int = Field(description="bytes of the chunk files this server knows of, headers included")
    files: int = Field(description="chunk files this server knows of")
    rebuilt: bool = Field(description="the scan after start has ended (until then the cap is not yet known)")
    rebuild_seconds: float | None = Field(description="how long that scan took")
    hits: int = Field(description="chunks read from the file tier")
    misses: int = Field(description="reads that found nothing usable (bad files included)")
    bad_files: int = Field(description="files refused and removed: truncated, damaged, foreign")
    get_failures: int = Field(description="reads and lookups that failed: timeouts, I/O errors")
    read_ahead: int = Field(description="chunks read into L1 because a LOOKUP found them on disk")
    read_in_place: int = Field(
        description="chunks read from the page cache straight into a worker's blocks (no staging in L1)"
    )
    promoted: int = Field(description="chunks read in place, then brought into L1 behind the RETRIEVE")
    puts: int = Field(description="chunk files written")
    coded_puts: int = Field(0, description="chunk files written coded (fs_compression lossless)")
    coded_bytes_saved: int = Field(0, description="bytes coding saved against the chunks' raw size")
    put_failures: int = Field(description="writes that failed: no space, read-only, vanished, I/O errors")
    evictions: int = Field(description="files removed to keep the cap")
    queue_depth: int = Field(description="writes waiting in the write-behind queue")
    queue_bytes: int
    dropped_writes: int = Field(
        description="writes dropped: queue full, tier bypassed, shutdown, out of space"
    )
    space: SpacePublic = Field(description="room for writes (a full disk stops them)")
    stalled_seconds: float = Field(description="how long the oldest disk call in progress has run")
    ping_latency_seconds: float = Field(description="the last health probe's round trip")
    ping_error_code: int = Field(description="the last health probe: 0 ok, -1 timeout or stuck, -2 other")


class StoragePublic(BaseModel):
    l1: L1Public
    fs: FsPublic | None = Field(description="the file tier (null without fs_path)")
    remote: RemotePublic | None


class HealthSummaryPublic(BaseModel):
    fallback_policy: str
    checks: list[CheckPublic]
    bypassed_backends: list[str]


class StatusPublic(BaseModel):
    """The whole server at a glance (`GET /status`)."""

    server: ServerPublic
    is_healthy: bool
    worker_liveness: WorkerLivenessPublic
    instances: list[InstancePublic]
    storage: StoragePublic
    health: HealthSummaryPublic


class ReapResult(BaseModel):
    """Outcome of `POST /instances/{instance_id}/reap`."""

    instance_id: int
    reaped: bool = Field(description="true when the instance was released by this call")
    dry_run: bool
    released: list[str] = Field(
        description="modules that released the instance (dry run: that would release it)"
    )


class CacheClear(BaseModel):
    """Body of `POST /v1/cache/clear`: the model whose chunks go, as its workers register it;
    with a salt, an adapter or both, only the chunks stored under them."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256, description="the served model name its workers register")
    salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_SALT_CHARS,
        description="only the chunks of this tenant's cache_salt (under any adapter, unless one is given)",
    )
    adapter: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_ADAPTER_CHARS,
        description="only the chunks of this LoRA adapter, by the name the engine's requests give it "
        "(under any salt, unless one is given)",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_namespace(cls, data: Any) -> Any:
        if isinstance(data, dict) and "namespace" in data:
            raise ValueError(
                "namespace: name the LoRA adapter instead ('adapter', the name the engine's "
                "requests give it), as /v1/lookup does"
            )
        return data


class CacheCleared(BaseModel):
    """Outcome of `POST /v1/cache/clear` (200: complete; 503: a tier could not be cleared, or a
    chunk stayed held by a reader: what was removed is still reported)."""

    model: str
    scopes: int = Field(description="the model's scopes cleared (one per layout and rank)")
    removed: int = Field(description="chunks removed, in all tiers")
    l1: int = Field(description="chunks dropped from L1")
    fs: int = Field(description="chunk files removed from the file tier")
    remote: int = Field(description="chunks removed from the remote tier")
    pinned: int = Field(description="L1 chunks a reader still held at the deadline (they stay)")
    failed: list[str] = Field(description="tiers that could not be cleared (down, an error)")
    complete: bool = Field(description="nothing of the model is left in any tier")
