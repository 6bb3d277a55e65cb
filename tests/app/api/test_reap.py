"""POST /instances/{id}/reap: every status code, the real release, the audit line, the counter."""

from __future__ import annotations

import logging

import httpx
import pytest
from pydantic import SecretStr

from dataplane.server.runtime import DataPlane
from tests.app.conftest import AUTH, TOKEN, AppFactory, DataPlaneFactory, WorkerFactory, mappings_of

AUDIT_LOGGER = "app.api.audit"


def admin_reaped(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith('kvwarden_instances_reaped_total{reason="admin"}'):
            return float(line.split()[-1])
    raise AssertionError('kvwarden_instances_reaped_total{reason="admin"} not exposed')


def audit_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == AUDIT_LOGGER]


def test_reap_releases_the_instance(
    client: httpx.Client, dp: DataPlane, make_worker: WorkerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = make_worker(), make_worker()
    assert mappings_of(a.segment) == 2  # the worker's own mapping and the server's
    before = admin_reaped(client)
    caplog.set_level(logging.WARNING, logger=AUDIT_LOGGER)
    r = client.post(f"/instances/{a.id}/reap", headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"instance_id": a.id, "reaped": True, "dry_run": False, "released": ["server_driven"]}
    # gone from every view, its mapping released, counted, audited; b untouched
    assert client.get(f"/instances/{a.id}").status_code == 404
    assert [i["instance_id"] for i in client.get("/status").json()["instances"]] == [b.id]
    assert mappings_of(a.segment) == 1
    assert mappings_of(b.segment) == 2
    assert admin_reaped(client) == before + 1
    (line,) = audit_lines(caplog)
    assert line.levelno == logging.WARNING
    msg = line.getMessage()
    for part in (
        "who=admin (token ok)",
        "from=127.0.0.1:",
        f"instance='{a.id}'",
        "dry_run='false'",
        "outcome=200",
        "released server_driven",
    ):
        assert part in msg, msg
    # the live worker learns from its next PING that it is unknown, and registers once afresh
    a.adapter.heartbeat_once()
    assert a.adapter.registrations == 2
    assert client.get(f"/instances/{a.id}").status_code == 200
    assert b.adapter.registrations == 1


def test_reap_dry_run_releases_nothing(
    client: httpx.Client, make_worker: WorkerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    w = make_worker()
    before = admin_reaped(client)
    caplog.set_level(logging.WARNING, logger=AUDIT_LOGGER)
    r = client.post(f"/instances/{w.id}/reap", params={"dry_run": "true"}, headers=AUTH)
    assert r.status_code == 200
    assert r.json() == {"instance_id": w.id, "reaped": False, "dry_run": True, "released": ["server_driven"]}
    assert client.get(f"/instances/{w.id}").status_code == 200
    assert mappings_of(w.segment) == 2
    assert admin_reaped(client) == before
    assert w.adapter.store(list(range(32)), [0, 1])
    (line,) = audit_lines(caplog)
    assert "dry_run='true'" in line.getMessage() and "outcome=200" in line.getMessage()


def test_reap_without_token_is_401_with_challenge(
    client: httpx.Client, make_worker: WorkerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    w = make_worker()
    caplog.set_level(logging.WARNING, logger=AUDIT_LOGGER)
    r = client.post(f"/instances/{w.id}/reap")
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert client.get(f"/instances/{w.id}").status_code == 200
    (line,) = audit_lines(caplog)
    assert "who=refused (no bearer token)" in line.getMessage()
    assert "outcome=401" in line.getMessage()


@pytest.mark.parametrize(
    "header", [f"Bearer {TOKEN}x", "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}", "Bearer"]
)
def test_reap_with_wrong_token_is_401(client: httpx.Client, make_worker: WorkerFactory, header: str) -> None:
    w = make_worker()
    r = client.post(f"/instances/{w.id}/reap", headers={"Authorization": header})
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert client.get(f"/instances/{w.id}").status_code == 200


@pytest.mark.parametrize("token", [None, ""])
def test_reap_without_configured_token_is_403(
    make_dp: DataPlaneFactory, serve_app: AppFactory, token: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    dp = make_dp(admin_token=None if token is None else SecretStr(token))
    c = serve_app(dp)
    caplog.set_level(logging.WARNING, logger=AUDIT_LOGGER)
    for headers in ({}, AUTH):
        r = c.post("/instances/1/reap", headers=headers)
        assert r.status_code == 403
        assert "no admin token" in r.json()["detail"]
    assert len(audit_lines(caplog)) == 2
    assert all("outcome=403" in rec.getMessage() for rec in audit_lines(caplog))


def test_reap_unknown_id_is_404(
    client: httpx.Client, make_worker: WorkerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    w = make_worker()
    before = admin_reaped(client)
    other = (w.id + 1) % (1 << 63)
    caplog.set_level(logging.WARNING, logger=AUDIT_LOGGER)
    for params in ({}, {"dry_run": "true"}):
        r = client.post(f"/instances/{other}/reap", params=params, headers=AUTH)
        assert r.status_code == 404
        assert r.json() == {"detail": f"instance {other} is not tracked"}
    assert admin_reaped(client) == before
    assert client.get(f"/instances/{w.id}").status_code == 200
    assert [("outcome=404" in rec.getMessage()) for rec in audit_lines(caplog)] == [True, True]


@pytest.mark.parametrize("bad", ["abc", "-1", str(1 << 63), "1.5", str(1 << 64)])
def test_reap_bad_id_is_422(client: httpx.Client, bad: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=AUDIT_LOGGER)
    r = client.post(f"/instances/{bad}/reap", headers=AUTH)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["path", "instance_id"]
    (line,) = audit_lines(caplog)
    assert "outcome=422" in line.getMessage() and "who=admin (token ok)" in line.getMessage()


def test_reap_bad_dry_run_is_422(client: httpx.Client, make_worker: WorkerFactory) -> None:
    w = make_worker()
    r = client.post(f"/instances/{w.id}/reap", params={"dry_run": "perhaps"}, headers=AUTH)
    assert r.status_code == 422
    assert client.get(f"/instances/{w.id}").status_code == 200


def test_reap_of_the_largest_id_is_404_not_422(client: httpx.Client) -> None:
    r = client.post(f"/instances/{(1 << 63) - 1}/reap", headers=AUTH)
    assert r.status_code == 404
    r = client.post("/instances/0/reap", headers=AUTH)
    assert r.status_code == 404
