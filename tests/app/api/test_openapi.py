"""The served OpenAPI document equals the committed openapi/openapi.json (no drift)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx

from app.main import create_app
from app.openapi import OPENAPI_PATH, render_openapi
from dataplane.server.runtime import DataPlane
from tests.helpers import ROOT, subprocess_env

OPERATIONS = {
    ("/livez", "get"): "health-livez",
    ("/health", "get"): "health-read_health",
    ("/status", "get"): "status-read_status",
    ("/instances", "get"): "instances-list_instances",
    ("/instances/{instance_id}", "get"): "instances-read_instance",
    ("/instances/{instance_id}/reap", "post"): "instances-reap_instance",
    ("/v1/cache/clear", "post"): "cache-clear_cache",
    ("/metrics", "get"): "metrics-read_metrics",
    ("/v1/lookup", "post"): "routing-lookup",
}


def test_committed_file_matches_the_app(dp: DataPlane) -> None:
    committed = OPENAPI_PATH.read_text()
    assert committed == render_openapi(create_app(dp)), (
        "openapi/openapi.json is out of date: run scripts/gen_openapi.py"
    )
    assert committed.endswith("}\n")


def test_served_document_equals_the_committed_file(client: httpx.Client) -> None:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    assert r.json() == json.loads(OPENAPI_PATH.read_text())


def test_operation_ids_are_stable() -> None:
    doc = json.loads(OPENAPI_PATH.read_text())
    got = {
        (path, method): op["operationId"]
        for path, item in doc["paths"].items()
        for method, op in item.items()
    }
    assert got == OPERATIONS
    reap = doc["paths"]["/instances/{instance_id}/reap"]["post"]
    assert set(reap["responses"]) == {"200", "401", "403", "404", "422"}
    assert reap["security"] == [{"HTTPBearer": []}]
    health = doc["paths"]["/health"]["get"]["responses"]
    assert set(health) == {"200", "503"}
    assert "application/health+json" in health["200"]["content"]


def test_generator_check_mode_agrees() -> None:
    proc = subprocess.run(
        [sys.executable, "scripts/gen_openapi.py", "--check"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout
