"""Server settings: one pydantic-settings class; flags (`--kebab-case`) and `KVWARDEN_*` env vars.

Flags win over environment variables, which win over the defaults. Every field has bounds and a
docstring; cross-field rules are checked by the model validator, and each violation names the
setting and its rule in one line (see `format_validation_error`).
"""

from __future__ import annotations

import enum
import math
import resource
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dataplane.health.base import FallbackPolicy
from dataplane.server.token_file import read_token_file
from dataplane.storage.evict import Eviction
from dataplane.storage.remote.redis_client import CLUSTER_SCHEME, parse_cluster_url
from dataplane.wire.protocol import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_MAX_FRAME_BYTES,
    REAP_TIMEOUT_FLOOR_S,
)

# The interpreter's switch interval in a server process: the GIL hands over every 0.5 ms instead
# of 5, so a PING on the loop thread (which takes the GIL several times) never waits long behind
# an HTTP thread building /status (copies release the GIL anyway).
SWITCH_INTERVAL_S = 0.0005
# Descriptors the server keeps beyond its connection cap (`connection_cap`): its own files, the
# HTTP sidecar's clients, the remote tier's sockets, connections accepted and not yet refused.
FD_KEEP = 256


class L1Backing(enum.StrEnum):
    AUTO = "auto"  # shared memory when the segment directory has room, else private
    SHM = "shm"  # a server-owned segment: engine-driven workers copy once, straight into L1
    PRIVATE = "private"  # anonymous memory no worker can map: engine-driven workers use the pool


class LogLevel(enum.StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


Port = Annotated[int, Field(ge=1, le=65535)]


def _finite(name: str, v: float) -> float:
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


class Settings(BaseSettings):
    """Every setting of `kvwarden serve`."""

    model_config = SettingsConfigDict(
        env_prefix="KVWARDEN_", extra="forbid", validate_default=True, frozen=True
    )

    host: str = Field("127.0.0.1", min_length=1, description="ZMQ ROUTER bind host.")
    port: Port = Field(5555, description="ZMQ ROUTER bind port.")
    ipc_path: str | None = Field(
        None,
        min_length=1,
        max_length=100,
        description="Serve the data plane on this Unix socket (ipc://) instead of TCP host/port: "
        "created mode 600, so only the server's user can connect (docs/security.md).",
    )
    max_connections: int = Field(
        1024,
        ge=1,
        le=1 << 20,
        description="Data-plane connections open at once; one beyond them is closed as soon as it is "
        f"accepted (counted). Must leave {FD_KEEP} descriptors under the open-files limit (checked "
        "at start); the default is lowered to fit.",
    )
    http_host: str = Field("127.0.0.1", min_length=1, description="HTTP sidecar bind host.")
    http_port: Port = Field(8080, description="HTTP sidecar bind port.")
    http_max_connections: int = Field(
        256,
        ge=1,
        le=65536,
        description="Open HTTP connections the sidecar serves; a request beyond them gets 503 and "
        "its connection is closed. Idle connections close after 5 s (keep-alive timeout).",
    )
    # 128: one block of vLLM's CPU cache, eight of its GPU one. A hit ends at a chunk boundary,
    # so up to chunk_size - 1 tokens after it are recomputed: at 256, a hit of a 3,000-token
    # prompt took twice vLLM's own hit of it (bench serve)
    chunk_size: int = Field(128, gt=0, le=1 << 20, description="Tokens per chunk; > 0.")
    l1_size_gb: float = Field(4.0, gt=0, le=1 << 14, description="Local CPU tier capacity (GiB); > 0.")
    l1_tenant_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of L1 one tenant (a cache salt; no salt is one tenant too) may hold before "
        "its stores evict only its own chunks; 0 (the default) = no shares: every store evicts the least "
        "recently used chunk, whoever's.",
    )
    l1_eviction: Eviction = Field(
        Eviction.LRU,
        description="lru|lfuda: what L1 evicts to make room: the least recently used chunk, or the least "
        "often read, aged (README). A tenant at its share evicts its own least recently used either way.",
    )
    l1_backing: L1Backing = Field(
        L1Backing.AUTO,
        description="auto|shm|private: L1's memory. shm lets engine-driven workers map all of L1 "
        "and copy once (one trust domain); private keeps it from every worker (docs/security.md); "
        "auto is shm when the segment directory has room.",
    )
    max_cpu_workers: int = Field(4, ge=1, le=256, description="NORMAL pool threads (LOOKUP, control).")
    max_transfer_workers: int = Field(2, ge=1, le=256, description="STORE/RETRIEVE pool threads.")
    max_frame_bytes: int = Field(
        DEFAULT_MAX_FRAME_BYTES, ge=4096, le=1 << 30, description="Largest request frame accepted."
    )
    remote_url: str | None = Field(
        None,
        description="redis://host:port/db, rediss://... (TLS) or redis+cluster://host:port[,host:port...]",
    )
    remote_password: SecretStr | None = Field(None, description="Password for the remote tier.")
    remote_timeout_seconds: float = Field(1.0, gt=0, le=600, description="Bound on one remote get/put.")
    remote_key_prefix: str = Field(
        "kvwarden:",
        min_length=1,
        max_length=64,
        pattern=r"^[!-~]+$",
        description="Prefix of every remote key (printable, no spaces): servers sharing chunks share it.",
    )
    remote_compression: Literal["none", "lossless"] = Field(
        "none",
        description="How the remote tier stores bfloat16 and float16 chunks: lossless codes them "
        "(about 1.47x smaller on a trained model's KV, so Redis holds as many more; a chunk that "
        "saves less than 5% stays as it is), none stores every chunk as it is. Readers decode "
        "either. Off by default: a hit from Redis on loopback took 1.06-1.56x as long coded.",
    )
    remote_write_queue_mb: int = Field(
        256, ge=1, le=1 << 20, description="Write-behind queue to the remote tier (MiB); more is dropped."
    )
    fs_path: Path | None = Field(
        None,
        description="Directory of the file tier (local NVMe, or a mount several servers share); it "
        "must exist. Chunks written there survive restarts. Off without it.",
    )
    fs_size_gb: float = Field(
        0.0,
        ge=0,
        le=1 << 20,
        description="Bytes the file tier may hold (GiB); needs fs_path, which needs it.",
    )
    fs_timeout_seconds: float = Field(
        1.0, gt=0, le=600, description="Deadline of one file-tier read; past it the read is a miss."
    )
    fs_write_queue_mb: int = Field(
        256, ge=1, le=1 << 20, description="Write-behind queue to the file tier (MiB); more is dropped."
    )
    fs_compression: Literal["none", "lossless"] = Field(
        "none",
        description="How the file tier stores bfloat16 and float16 chunks: lossless codes them on "
        "its writer thread (as remote_compression; the disk holds as many more), none stores "
        "every chunk as it is. Readers decode either; a coded file is decoded, never read in "
        "place into a worker's blocks.",
    )
    fs_eviction: Eviction = Field(
        Eviction.LRU,
        description="lru|lfuda: which file the file tier removes to stay under fs_size_gb: the least "
        "recently used, or the least often read, aged (as l1_eviction; the order starts afresh at restart).",
    )
    kv_events_endpoint: str | None = Field(
        None,
        description="ZMQ PUB endpoint of the KV events (vLLM's format, for KV-aware routers): "
        "tcp://*:5557 binds, tcp://host:port connects (to a proxy). Off without it.",
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        description="ZMQ ROUTER endpoint (bound) where a subscriber asks for the batches it "
        "missed, e.g. tcp://*:5558; needs kv_events_endpoint.",
    )
    kv_events_topic: str = Field(
        "",
        max_length=256,
        description="Topic of every event message (llm-d: kv@<pod>@<model>); needs kv_events_endpoint.",
    )
    local_cpu: bool = Field(
        True,
        description="L1 keeps chunks as a hot cache; false = L1 only stages writes (needs remote_url "
        "or fs_path).",
    )
    worker_reap_timeout_seconds: float = Field(
        120.0, ge=0, description="Silence after which a pinging worker is reaped; 0 disables; >= 30."
    )
    worker_registration_grace_seconds: float = Field(
        3600.0, ge=0, description="Silence allowed to a worker that never pinged; >= reap timeout."
    )
    worker_disconnect_grace_seconds: float = Field(
        10.0, ge=0, description="Reap this long after a worker's connection closed; 0 disables."
    )
    health_ping_interval: float = Field(30.0, gt=0, description="Seconds between health rounds.")
    health_ping_timeout: float = Field(5.0, gt=0, description="Bound on one health ping.")
    get_blocking_failed_threshold: int = Field(10, ge=1, description="Failed gets per round that trip.")
    waiting_time_for_recovery: float = Field(300.0, ge=0, description="Least wait before recovery.")
    fallback_policy: FallbackPolicy = Field(FallbackPolicy.RECOMPUTE, description="recompute|local_cpu")
    max_instances: int = Field(
        4096, ge=1, le=1 << 20, description="Tracked instances, both transfer modes; more are refused."
    )
    max_instances_per_connection: int = Field(
        64, ge=1, le=1 << 20, description="Instances registered over one connection; more are refused."
    )
    max_pool_gb: float = Field(
        8.0, gt=0, le=1 << 14, description="Server-owned engine-driven pools, in all (GiB); more are refused."
    )
    max_mapped_gb: float = Field(
        1024.0,
        gt=0,
        le=1 << 20,
        description="Worker KV memory the server maps, in all (GiB); more is refused.",
    )
    admin_token: SecretStr | None = Field(
        None,
        description="Bearer token of the admin routes. As a flag it is visible to every local user "
        "(/proc/PID/cmdline): prefer admin_token_file or KVWARDEN_ADMIN_TOKEN.",
    )
    admin_token_file: Path | None = Field(
        None,
        description="File whose first line is the admin token; a regular file the owner alone "
        "may read (mode 600). Not together with admin_token.",
    )
    log_level: LogLevel = Field(LogLevel.INFO, description="Logging level.")

    _file_token: SecretStr | None = PrivateAttr(None)

    @field_validator(
        "l1_size_gb",
        "l1_tenant_share",
        "max_pool_gb",
        "max_mapped_gb",
        "remote_timeout_seconds",
        "fs_size_gb",
        "fs_timeout_seconds",
        "worker_reap_timeout_seconds",
        "worker_registration_grace_seconds",
        "worker_disconnect_grace_seconds",
        "health_ping_interval",
        "health_ping_timeout",
        "waiting_time_for_recovery",
    )
    @classmethod
    def _must_be_finite(cls, v: float) -> float:
        return _finite("value", v)

    @field_validator("remote_url")
    @classmethod
    def _remote_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", CLUSTER_SCHEME)):
            raise ValueError("must start with redis://, rediss:// or redis+cluster://")
        if v is not None and v.startswith(CLUSTER_SCHEME):
            parse_cluster_url(v)  # ValueError naming the node that is not host:port
        return v

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Settings:
        validate_liveness(
            self.worker_reap_timeout_seconds,
            self.worker_registration_grace_seconds,
            self.worker_disconnect_grace_seconds,
        )
        if not self.local_cpu and self.remote_url is None and self.fs_path is None:
            raise ValueError(
                "local_cpu=false needs remote_url or fs_path: L1 would only stage writes for a lower tier"
            )
        if (self.fs_path is None) != (self.fs_size_gb == 0):
            raise ValueError(
                "fs_path and fs_size_gb: give both (a directory and the GiB it may hold) or neither"
            )
        if self.fs_path is not None and not self.fs_path.is_dir():
            raise ValueError(
                f"fs_path {str(self.fs_path)!r}: not a directory (create it, or mount the volume there)"
            )
        _check_events(self.kv_events_endpoint, self.kv_events_replay_endpoint, self.kv_events_topic)
        if self.ipc_path is not None and {"host", "port"} & self.model_fields_set:
            raise ValueError("ipc_path and host/port: the data plane listens on one of them, not both")
        if self.admin_token_file is not None:
            if self.admin_token is not None:
                raise ValueError("admin_token and admin_token_file: give one of them, not both")
            try:  # read here, once: a bad file fails before anything binds
                self._file_token = SecretStr(read_token_file(self.admin_token_file))
            except ValueError as exc:
                raise ValueError(f"admin_token_file: {exc}") from None
        return self

    def admin_secret(self) -> SecretStr | None:
        """The admin token, from ``admin_token`` or the file of ``admin_token_file`` (read once,
        when the settings were validated); None when neither is set."""
        return self._file_token if self.admin_token_file is not None else self.admin_token

    def connection_cap(self, limit: int | None) -> int:
        """The cap on data-plane connections under the open-files limit ``limit`` (None:
        unlimited). ``max_connections`` holds when it leaves `FD_KEEP` descriptors under the
        limit; one that was given and does not is refused (ValueError naming the setting, the
        limit and the most that holds), the default is lowered to half of what the limit leaves
        (registrations keep the other half for their mappings)."""
        cap = self.max_connections
        if limit is None:
            return cap
        room = limit - FD_KEEP
        if "max_connections" in self.model_fields_set:
            if cap > room:
                raise ValueError(
                    f"max_connections={cap}: cannot be honoured under the open-files limit of {limit} "
                    f"(RLIMIT_NOFILE, raised to the hard limit at start): the server keeps {FD_KEEP} "
                    f"descriptors beyond its connections, so at most {max(room, 0)} here; lower "
                    "--max-connections or raise the limit (ulimit -n)"
                )
            return cap
        if room // 2 < 1:
            raise ValueError(
                f"max_connections: the open-files limit of {limit} (RLIMIT_NOFILE) leaves no room "
                f"for connections beside the {FD_KEEP} descriptors the server keeps; raise it (ulimit -n)"
            )
        return min(cap, room // 2)

    @property
    def l1_capacity_bytes(self) -> int:
        return int(self.l1_size_gb * (1 << 30))

    @property
    def l1_tenant_share_bytes(self) -> int | None:
        return int(self.l1_tenant_share * self.l1_capacity_bytes) if self.l1_tenant_share else None

    @property
    def zmq_endpoint(self) -> str:
        if self.ipc_path is not None:
            return f"ipc://{self.ipc_path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def _check_events(endpoint: str | None, replay: str | None, topic: str) -> None:
    for name, v in (("kv_events_endpoint", endpoint), ("kv_events_replay_endpoint", replay)):
        if v is not None and not v.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"{name} {v!r}: must start with tcp://, ipc:// or inproc://")
    if endpoint is None and (replay is not None or topic):
        raise ValueError(
            "kv_events_replay_endpoint and kv_events_topic need kv_events_endpoint (events are off)"
        )
    if replay is not None and replay == endpoint:
        raise ValueError("kv_events_replay_endpoint: must differ from kv_events_endpoint")


def fd_limit() -> int | None:
    """The soft limit on open files (RLIMIT_NOFILE); None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def validate_liveness(timeout: float, grace: float, disconnect: float = 0.0) -> None:
    """The user-facing liveness rules (ValueError naming the setting and the rule)."""
    hb = DEFAULT_HEARTBEAT_INTERVAL_S
    if not math.isfinite(timeout) or timeout < 0 or (0 < timeout < REAP_TIMEOUT_FLOOR_S):
        raise ValueError(
            f"worker_reap_timeout_seconds={timeout}: must be 0 (disabled) or finite and >= "
            f"{REAP_TIMEOUT_FLOOR_S:g} s; use at least 3 x the workers' heartbeat interval "
            f"(default {hb:g} s)"
        )
    if not math.isfinite(grace) or grace < timeout:
        raise ValueError(
            f"worker_registration_grace_seconds={grace}: must be finite and >= "
            f"worker_reap_timeout_seconds ({timeout:g}); a tighter grace would reap warming "
            "workers faster than crashed ones"
        )
    if not math.isfinite(disconnect) or disconnect < 0 or 0 < disconnect < 1:
        raise ValueError(
            f"worker_disconnect_grace_seconds={disconnect}: must be 0 (disabled) or finite and >= 1 s"
        )
    if timeout > 0 and disconnect > timeout:
        raise ValueError(
            f"worker_disconnect_grace_seconds={disconnect}: must be <= worker_reap_timeout_seconds "
            f"({timeout:g}) when reaping is on"
        )


def format_validation_error(err: ValidationError) -> str:
    """One line per violated rule: `setting: rule`."""
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "settings"
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc != "settings" else msg)
    return "; ".join(parts)
