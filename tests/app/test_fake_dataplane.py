"""The sidecar over a fake data plane: `DataPlaneView` is a Protocol, so the real app, served by
the real `Sidecar` on a real socket, can read a fake whose every value a test sets. That reaches
what a real data plane makes hard to reach: a dead loop thread, a dead reaper, shut pools, exact
liveness and L1 figures, an injected clock, and which facade calls a route makes."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.models import HealthPublic
from dataplane.server.config import Settings
from dataplane.server.facade import (
    CheckResult,
    ComponentState,
    ContextEntry,
    DataPlaneView,
    EventsState,
    FsStats,
    L1Stats,
    LivenessRow,
    LivenessStatus,
    ModelCleared,
    MonitorState,
    RemoteState,
    ServerInfo,
    TenantStats,
    TierHits,
)
from tests.app.conftest import AUTH, TOKEN, AppFactory

HEALTH_MEDIA_TYPE = "application/health+json"
# the fake's own metrics text: what /metrics must pass through untouched, first
FAKE_METRICS = (
    b"# HELP kvwarden_fake_marker A sample only the fake data plane renders.\n"
    b"# TYPE kvwarden_fake_marker gauge\n"
    b"kvwarden_fake_marker 42.0\n"
)
RUNNING = ComponentState(
    state="running", loop_alive=True, loop_error=None, pools_alive=True, reaper_alive=True
)


def entry(instance_id: int, *, registered_at: float, last_seen: float, **kw: Any) -> ContextEntry:
    fields: dict[str, Any] = {
        "instance_id": instance_id,
        "transfer_mode": "server_driven",
        "memory": "shm",
        "model_name": "m",
        "world_size": 1,
        "worker_id": 0,
        "owner_pid": 4242,
        "num_layers": 2,
        "dtype": "bfloat16",
        "registered_at": registered_at,
        "last_seen": last_seen,
        "has_liveness_signal": False,
        "disconnected": False,
        "conn_fd": 7,
    }
    fields.update(kw)
    return ContextEntry(**fields)


def self_check_problems(c: ComponentState) -> dict[str, str | None]:
    """What `dataplane.server.runtime`'s self checks answer for the component state ``c``."""
    if c.loop_error is not None:
        loop: str | None = f"loop thread died: {c.loop_error}"
    elif not c.loop_alive:
        loop = f"loop thread is not running (server {c.state})"
    else:
        loop = None
    out = {"dataplane:loop": loop, "dataplane:pools": None if c.pools_alive else "worker pools shut down"}
    if c.reaper_alive is not None:
        out["dataplane:reaper"] = None if c.reaper_alive else "worker reaper thread is not running"
    return out


class FakeDataPlane:
    """A `DataPlaneView` of plain fields a test sets: no ZMQ, no threads, an injected clock.
    It records every ``force_reap`` call, and ``force_reap`` releases like the real one: it
    answers the names of the modules that held the id (none when untracked)."""

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings if settings is not None else Settings.model_validate({"admin_token": TOKEN})
        self.info = ServerInfo(
            server_id="fake-server-1",
            boot_token=123_456_789,
            version="9.8.7-fake",
            protocol_version=4,
            started_at=time.time(),
            endpoint="tcp://127.0.0.1:65001",
            chunk_size=64,
            max_frame_bytes=1 << 20,
        )
        self.now = 5_000.0
        self.entries: dict[int, ContextEntry] = {}
        self.liveness = LivenessStatus(
            enabled=True,
            reap_timeout_seconds=33.5,
            registration_grace_seconds=77.25,
            disconnect_grace_seconds=4.5,
            tracked_instances=0,
            reaped_total=17,
        )
        self.l1 = L1Stats(
            used_bytes=3_145_728,
            capacity_bytes=8_388_608,
            chunks=12,
            hot_cache=False,
            evictions=5,
            rejected=2,
            tenants=[TenantStats("t-00ff", 2_097_152, 8, 30, 1), TenantStats("unsalted", 1_048_576, 4, 0, 4)],
            tenant_share_bytes=4_194_304,
            hits=40,
            share_evictions=1,
        )
        self.state = RUNNING
        self.metrics_text = FAKE_METRICS
        self.force_reap_calls: list[int] = []
        self.monitor = MonitorState(True, None, None, 0, (), ())
        self.remote: RemoteState | None = None

    @property
    def settings(self) -> Settings:
        return self._settings

    def server_info(self) -> ServerInfo:
        return self.info

    def clock(self) -> float:
        return self.now

    def context_entries_snapshot(self) -> list[ContextEntry]:
        return list(self.entries.values())

    def liveness_rows(self) -> list[LivenessRow]:
        return [
            (e.instance_id, e.registered_at, e.last_seen, e.has_liveness_signal, e.disconnected)
            for e in self.entries.values()
        ]

    def context_entry(self, instance_id: int) -> ContextEntry | None:
        return self.entries.get(instance_id)

    def holders_of(self, instance_id: int) -> list[str]:
        e = self.entries.get(instance_id)
        return [] if e is None else [e.transfer_mode]

    def tracked_by_mode(self) -> dict[str, int]:
        counts = {"server_driven": 0, "engine_driven": 0}
        for e in self.entries.values():
            counts[e.transfer_mode] += 1
        return counts

    def liveness_status(self) -> LivenessStatus:
        return self.liveness

    def l1_stats(self) -> L1Stats:
        return self.l1

    def components(self) -> ComponentState:
        return self.state

    def monitor_state(self) -> MonitorState:
        """The data plane's own live checks, derived from ``state`` as the real data plane's
        monitor runs them, then whatever a test put in ``monitor``."""
        own = tuple(
            CheckResult(name, "pass" if problem is None else "fail", problem or "")
            for name, problem in self_check_problems(self.state).items()
        )
        results = (*own, *self.monitor.results)
        return replace(
            self.monitor, healthy=self.monitor.healthy and all(c.healthy for c in own), results=results
        )

    def remote_state(self) -> RemoteState | None:
        return self.remote

    def fs_state(self) -> FsStats | None:
        return None

    def events_state(self) -> EventsState | None:
        return None

    def lookup_hashes(self, model: str, hashes: Any, block_size: int) -> TierHits:
        return TierHits(len(hashes) * block_size, 256, 0, 0, 0, 0, False)

    def lookup_tiers(
        self, model: str, token_ids: Any, salt: str | None = None, adapter: str | None = None
    ) -> TierHits:
        return TierHits(len(token_ids), 256, 0, 0, 0, 0, False)

    def force_reap(self, instance_id: int) -> list[str]:
        self.force_reap_calls.append(instance_id)
        e = self.entries.pop(instance_id, None)
        return [] if e is None else [e.transfer_mode]

    def clear_model(
        self, model: str, who: str, salt: str | None = None, adapter: str | None = None
    ) -> ModelCleared:
        return ModelCleared(0, 0, 0, 0, 0, ())

    def render_metrics(self) -> bytes:
        return self.metrics_text


# the structural check: mypy fails here if the fake stops implementing the Protocol
_CONFORMS: DataPlaneView = FakeDataPlane()


@pytest.fixture
def fake() -> FakeDataPlane:
    return FakeDataPlane()


@pytest.fixture
def client(fake: FakeDataPlane, serve_app: AppFactory) -> httpx.Client:
    return serve_app(fake)


def health(client: httpx.Client, expect: int) -> HealthPublic:
    r = client.get("/health")
    assert r.status_code == expect, r.text
    assert r.headers["content-type"].startswith(HEALTH_MEDIA_TYPE)
    return HealthPublic.model_validate(r.json())


# ------------------------------------------------------------------------------------ /health


def test_health_is_200_pass_when_every_component_is_alive(client: httpx.Client, fake: FakeDataPlane) -> None:
    body = health(client, 200)
    assert body.status == "pass"
    assert body.output == ""
    assert (body.service_id, body.version) == ("fake-server-1", "9.8.7-fake")
    assert sorted(body.checks) == ["dataplane:loop", "dataplane:pools", "dataplane:reaper"]
    for name, results in body.checks.items():
        assert [(c.name, c.status, c.output) for c in results] == [(name, "pass", "")]


FAILURES = [
    pytest.param(
        replace(RUNNING, state="stopped", loop_alive=False, loop_error="RuntimeError('boom')"),
        "dataplane:loop",
        "loop thread died: RuntimeError('boom')",
        id="loop-thread-died",
    ),
    pytest.param(
        replace(RUNNING, state="draining", loop_alive=False),
        "dataplane:loop",
        "loop thread is not running (server draining)",
        id="loop-not-running",
    ),
    pytest.param(
        replace(RUNNING, pools_alive=False), "dataplane:pools", "worker pools shut down", id="pools-shut-down"
    ),
    pytest.param(
        replace(RUNNING, reaper_alive=False),
        "dataplane:reaper",
        "worker reaper thread is not running",
        id="reaper-dead",
    ),
]


@pytest.mark.parametrize(("broken", "failing", "why"), FAILURES)
def test_health_is_503_naming_the_one_failing_check(
    client: httpx.Client, fake: FakeDataPlane, broken: ComponentState, failing: str, why: str
) -> None:
    assert health(client, 200).status == "pass"
    fake.state = broken
    body = health(client, 503)
    assert body.status == "fail"
    assert body.output == f"{failing}: {why}"
    statuses = {name: [(c.status, c.output) for c in cs] for name, cs in body.checks.items()}
    expected = {name: [("pass", "")] for name in ("dataplane:loop", "dataplane:pools", "dataplane:reaper")}
    expected[failing] = [("fail", why)]
    assert statuses == expected
    # /status and the healthy gauge read the same checks
    doc = client.get("/status").json()
    assert doc["is_healthy"] is False
    assert {c["name"]: (c["status"], c["output"]) for c in doc["health"]["checks"]}[failing] == ("fail", why)
    assert metric_value(client.get("/metrics").text, "kvwarden_healthy") == 0.0
    # every request runs the checks afresh: repaired, it passes again
    fake.state = RUNNING
    assert health(client, 200).status == "pass"
    assert metric_value(client.get("/metrics").text, "kvwarden_healthy") == 1.0


def test_no_reaper_check_when_reaping_is_disabled(serve_app: AppFactory) -> None:
    fake = FakeDataPlane()
    fake.state = replace(RUNNING, reaper_alive=None)  # reaping disabled: decided when the app is built
    client = serve_app(fake)
    body = health(client, 200)
    assert sorted(body.checks) == ["dataplane:loop", "dataplane:pools"]


# ------------------------------------------------------------------------------------ /status


def test_status_fields_are_the_facade_values(client: httpx.Client, fake: FakeDataPlane) -> None:
    # started "in the future": uptime clamps to exactly 0.0 (it reads the wall clock)
    fake.info = replace(fake.info, started_at=time.time() + 3600)
    fake.entries = {
        11: entry(11, registered_at=4_000.0, last_seen=4_990.0, model_name="llama", has_liveness_signal=True),
        (1 << 63) - 1: entry(
            (1 << 63) - 1,
            registered_at=4_500.0,
            last_seen=5_001.0,  # ahead of the clock: clamps to 0.0
            transfer_mode="engine_driven",
            memory="cuda_ipc",
            model_name="qwen",
            world_size=4,
            worker_id=3,
            disconnected=True,
        ),
    }
    fake.liveness = replace(fake.liveness, tracked_instances=2, blend_instances=1, blend_kernel="ready")
    r = client.get("/status")
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {
        "server": {
            "server_id": "fake-server-1",
            "boot_token": 123_456_789,
            "version": "9.8.7-fake",
            "uptime_seconds": 0.0,
            "zmq_endpoint": "tcp://127.0.0.1:65001",
            "chunk_size": 64,
        },
        "is_healthy": True,
        "worker_liveness": {
            "enabled": True,
            "reap_timeout_seconds": 33.5,
            "registration_grace_seconds": 77.25,
            "disconnect_grace_seconds": 4.5,
            "tracked_instances": 2,
            "reaped_total": 17,
            "blend_instances": 1,
            "blend_kernel": "ready",
        },
        "instances": [
            {
                "instance_id": 11,
                "transfer_mode": "server_driven",
                "memory": "shm",
                "model_name": "llama",
                "world_size": 1,
                "worker_id": 0,
                "registered_seconds_ago": 1_000.0,
                "last_seen_seconds_ago": 10.0,
                "has_liveness_signal": True,
                "disconnected": False,
            },
            {
                "instance_id": (1 << 63) - 1,
                "transfer_mode": "engine_driven",
                "memory": "cuda_ipc",
                "model_name": "qwen",
                "world_size": 4,
                "worker_id": 3,
                "registered_seconds_ago": 500.0,
                "last_seen_seconds_ago": 0.0,
                "has_liveness_signal": False,
                "disconnected": True,
            },
        ],
        "storage": {
            "l1": {
                "used_bytes": 3_145_728,
                "capacity_bytes": 8_388_608,
                "chunks": 12,
                "hot_cache": False,
                "policy": "lru",
                "hits": 40,
                "evictions": 5,
                "evictions_by_reason": {"capacity": 4, "tenant_share": 1},
                "arena": None,
                "tenant_share_bytes": 4_194_304,
                "tenants": [
                    {"tenant": "t-00ff", "bytes": 2_097_152, "chunks": 8, "hits": 30, "evictions": 1},
                    {"tenant": "unsalted", "bytes": 1_048_576, "chunks": 4, "hits": 0, "evictions": 4},
                ],
            },
            "fs": None,
            "remote": None,
        },
        "health": {
            "fallback_policy": "recompute",
            "checks": [
                {"name": n, "status": "pass", "component_type": "component", "output": ""}
                for n in ("dataplane:loop", "dataplane:pools", "dataplane:reaper")
            ],
            "bypassed_backends": [],
        },
    }


def test_status_reads_the_clock_and_the_facade_on_every_request(
    client: httpx.Client, fake: FakeDataPlane
) -> None:
    started = time.time() - 1_000.0
    fake.info = replace(fake.info, started_at=started)
    fake.entries = {5: entry(5, registered_at=4_000.0, last_seen=4_900.0)}
    doc = client.get("/status").json()
    # the wall clock moves on its own: the uptime was read between the start and now
    assert 1_000.0 <= doc["server"]["uptime_seconds"] <= time.time() - started
    assert [(i["registered_seconds_ago"], i["last_seen_seconds_ago"]) for i in doc["instances"]] == [
        (1_000.0, 100.0)
    ]
    fake.now += 250.0
    fake.l1 = replace(fake.l1, used_bytes=1, chunks=1)
    fake.liveness = replace(fake.liveness, reaped_total=18)
    doc = client.get("/status").json()
    assert [(i["registered_seconds_ago"], i["last_seen_seconds_ago"]) for i in doc["instances"]] == [
        (1_250.0, 350.0)
    ]
    assert (doc["storage"]["l1"]["used_bytes"], doc["storage"]["l1"]["chunks"]) == (1, 1)
    assert doc["worker_liveness"]["reaped_total"] == 18


def test_instances_are_the_facade_entries(client: httpx.Client, fake: FakeDataPlane) -> None:
    assert client.get("/instances").json() == []
    fake.entries = {9: entry(9, registered_at=4_990.0, last_seen=4_995.5, model_name="x")}
    listed = client.get("/instances").json()
    one = client.get("/instances/9")
    assert one.status_code == 200
    assert listed == [one.json()]
    assert one.json() == {
        "instance_id": 9,
        "transfer_mode": "server_driven",
        "memory": "shm",
        "model_name": "x",
        "world_size": 1,
        "worker_id": 0,
        "registered_seconds_ago": 10.0,
        "last_seen_seconds_ago": 4.5,
        "has_liveness_signal": False,
        "disconnected": False,
    }
    r = client.get("/instances/10")
    assert (r.status_code, r.json()) == (404, {"detail": "instance 10 is not tracked"})


# ------------------------------------------------------------------------------ the admin reap


def test_reap_calls_force_reap_once_for_a_tracked_id(client: httpx.Client, fake: FakeDataPlane) -> None:
    fake.entries = {
        21: entry(21, registered_at=4_000.0, last_seen=4_000.0, transfer_mode="engine_driven"),
        22: entry(22, registered_at=4_000.0, last_seen=4_000.0),
    }
    r = client.post("/instances/21/reap", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"instance_id": 21, "reaped": True, "dry_run": False, "released": ["engine_driven"]}
    assert fake.force_reap_calls == [21]
    assert sorted(fake.entries) == [22]


def test_reap_of_an_untracked_id_is_404_from_the_facade_answer(
    client: httpx.Client, fake: FakeDataPlane
) -> None:
    """The route does not look before it reaps (that would race a concurrent release): it asks
    the data plane to reap, once, and answers 404 when no module held the id."""
    fake.entries = {22: entry(22, registered_at=4_000.0, last_seen=4_000.0)}
    r = client.post("/instances/23/reap", headers=AUTH)
    assert (r.status_code, r.json()) == (404, {"detail": "instance 23 is not tracked"})
    assert fake.force_reap_calls == [23]
    assert sorted(fake.entries) == [22]
    # reaping the same id twice: released once, then 404
    assert client.post("/instances/22/reap", headers=AUTH).status_code == 200
    assert client.post("/instances/22/reap", headers=AUTH).status_code == 404
    assert fake.force_reap_calls == [23, 22, 22]


def test_dry_run_never_calls_force_reap(client: httpx.Client, fake: FakeDataPlane) -> None:
    fake.entries = {31: entry(31, registered_at=4_000.0, last_seen=4_000.0)}
    r = client.post("/instances/31/reap", params={"dry_run": "true"}, headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"instance_id": 31, "reaped": False, "dry_run": True, "released": ["server_driven"]}
    r = client.post("/instances/32/reap", params={"dry_run": "true"}, headers=AUTH)
    assert (r.status_code, r.json()) == (404, {"detail": "instance 32 is not tracked"})
    assert fake.force_reap_calls == []
    assert sorted(fake.entries) == [31]


@pytest.mark.parametrize(
    ("url", "headers", "expect"),
    [
        pytest.param("/instances/41/reap", {}, 401, id="no-token"),
        pytest.param("/instances/41/reap", {"Authorization": f"Bearer {TOKEN}x"}, 401, id="wrong-token"),
        pytest.param("/instances/x41/reap", AUTH, 422, id="bad-id"),
        pytest.param("/instances/41/reap?dry_run=maybe", AUTH, 422, id="bad-dry-run"),
    ],
)
def test_a_refused_reap_never_calls_force_reap(
    client: httpx.Client, fake: FakeDataPlane, url: str, headers: dict[str, str], expect: int
) -> None:
    fake.entries = {41: entry(41, registered_at=4_000.0, last_seen=4_000.0)}
    assert client.post(url, headers=headers).status_code == expect
    assert fake.force_reap_calls == []
    assert sorted(fake.entries) == [41]


def test_reap_is_403_without_a_configured_token(serve_app: AppFactory) -> None:
    fake = FakeDataPlane(Settings.model_validate({"admin_token": None}))
    fake.entries = {51: entry(51, registered_at=4_000.0, last_seen=4_000.0)}
    client = serve_app(fake)
    r = client.post("/instances/51/reap", headers=AUTH)
    assert (r.status_code, r.json()) == (
        403,
        {"detail": "admin routes are disabled: the server has no admin token"},
    )
    assert fake.force_reap_calls == []


# ----------------------------------------------------------------------------------- /metrics


def metric_value(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"{name}{labels} not exposed")


def test_metrics_start_with_the_facade_text(client: httpx.Client, fake: FakeDataPlane) -> None:
    fake.entries = {
        1: entry(1, registered_at=4_000.0, last_seen=4_000.0),
        2: entry(2, registered_at=4_000.0, last_seen=4_000.0),
        3: entry(3, registered_at=4_000.0, last_seen=4_000.0, transfer_mode="engine_driven"),
    }
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert r.content.startswith(FAKE_METRICS)
    text = r.text
    assert metric_value(text, "kvwarden_fake_marker") == 42.0
    # the app's scrape-time gauges read the facade
    assert metric_value(text, "kvwarden_healthy") == 1.0
    assert metric_value(text, "kvwarden_tracked_instances", transfer_mode="server_driven") == 2.0
    assert metric_value(text, "kvwarden_tracked_instances", transfer_mode="engine_driven") == 1.0
    assert metric_value(text, "kvwarden_l1_used_bytes") == 3_145_728.0
    assert metric_value(text, "kvwarden_l1_capacity_bytes") == 8_388_608.0
    assert metric_value(text, "kvwarden_l1_evictions_total") == 5.0
    assert metric_value(text, "kvwarden_l1_evictions_by_reason_total", reason="capacity") == 4.0
    assert metric_value(text, "kvwarden_l1_evictions_by_reason_total", reason="tenant_share") == 1.0
    assert metric_value(text, "kvwarden_l1_hits_total") == 40.0
    # the facade's text is read on every scrape
    fake.metrics_text = FAKE_METRICS.replace(b"42.0", b"43.0")
    assert metric_value(client.get("/metrics").text, "kvwarden_fake_marker") == 43.0
