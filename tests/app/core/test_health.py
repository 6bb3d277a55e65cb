"""/livez and /health: media type, named checks, 200 pass / 200 warn / 503 fail."""

from __future__ import annotations

import httpx

from app.core.health import CheckResult, FunctionCheck, SidecarCheck, monitor_checks
from app.models import HealthPublic, StatusPublic
from dataplane.server.runtime import DataPlane
from tests.app.conftest import AppFactory, DataPlaneFactory


def test_livez_passes(client: httpx.Client) -> None:
    r = client.get("/livez")
    assert r.status_code == 200
    assert r.json() == {"status": "pass"}


def test_health_passes_with_every_data_plane_check(client: httpx.Client, dp: DataPlane) -> None:
    r = client.get("/health")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/health+json")
    body = HealthPublic.model_validate(r.json())
    assert body.status == "pass"
    assert set(body.checks) == {"dataplane:loop", "dataplane:pools", "dataplane:reaper"}
    assert all(c.status == "pass" for cs in body.checks.values() for c in cs)
    assert body.service_id == dp.server.server_id


def test_health_has_no_reaper_check_when_reaping_is_off(
    make_dp: DataPlaneFactory, serve_app: AppFactory
) -> None:
    c = serve_app(
        make_dp(
            worker_reap_timeout_seconds=0,
            worker_registration_grace_seconds=0,
            worker_disconnect_grace_seconds=0,
        )
    )
    r = c.get("/health")
    assert r.status_code == 200
    assert set(r.json()["checks"]) == {"dataplane:loop", "dataplane:pools"}


def test_health_fails_503_once_the_data_plane_loop_stopped(client: httpx.Client, dp: DataPlane) -> None:
    assert client.get("/health").status_code == 200
    assert dp.stop()
    r = client.get("/health")
    assert r.status_code == 503
    assert r.headers["content-type"].startswith("application/health+json")
    body = HealthPublic.model_validate(r.json())
    assert body.status == "fail"
    failing = {name for name, cs in body.checks.items() if cs[0].status == "fail"}
    assert {"dataplane:loop", "dataplane:pools", "dataplane:reaper"} <= failing
    assert "loop thread is not running" in body.checks["dataplane:loop"][0].output
    assert body.output.startswith("dataplane:")
    # liveness checks nothing else: still answering
    assert client.get("/livez").json() == {"status": "pass"}
    status = StatusPublic.model_validate(client.get("/status").json())
    assert status.is_healthy is False


class _Bypassed:
    """A check as the remote tier's monitor will give one under the local_cpu policy."""

    name = "remote:redis://cache:6379/0"

    def check(self) -> CheckResult:
        return CheckResult(
            self.name, "warn", "unreachable; bypassed", "datastore", bypassed_backend="redis://cache:6379/0"
        )


def test_a_pluggable_warning_check_answers_200_warn(dp: DataPlane, serve_app: AppFactory) -> None:
    def providers_extra(_dp: DataPlane) -> list[SidecarCheck]:
        return [_Bypassed()]

    c = serve_app(dp, check_providers=[monitor_checks, providers_extra])
    r = c.get("/health")
    assert r.status_code == 200
    assert r.json()["status"] == "warn"
    status = StatusPublic.model_validate(c.get("/status").json())
    assert status.is_healthy is True
    assert status.health.bypassed_backends == ["redis://cache:6379/0"]
    assert [ch.status for ch in status.health.checks if ch.name.startswith("remote:")] == ["warn"]


def test_a_check_that_raises_fails_the_health(dp: DataPlane, serve_app: AppFactory) -> None:
    def broken() -> str | None:
        raise RuntimeError("probe exploded")

    def provider(_dp: DataPlane) -> list[SidecarCheck]:
        return [FunctionCheck("custom:broken", broken)]

    c = serve_app(dp, check_providers=[monitor_checks, provider])
    r = c.get("/health")
    assert r.status_code == 503
    check = r.json()["checks"]["custom:broken"][0]
    assert check["status"] == "fail" and "probe exploded" in check["output"]
    assert r.json()["checks"]["dataplane:loop"][0]["status"] == "pass"
