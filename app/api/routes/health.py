"""Liveness (`/livez`: the HTTP server answers) and health (`/health`: the checks)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api.deps import DataPlaneDep, HealthDep
from app.core.status import check_view
from app.models import HealthPublic, LivezPublic

router = APIRouter(tags=["health"])

HEALTH_MEDIA_TYPE = "application/health+json"


class HealthJSONResponse(JSONResponse):
    media_type = HEALTH_MEDIA_TYPE


@router.get(
    "/livez",
    response_model=LivezPublic,
    name="livez",
    summary="The HTTP server answers (checks nothing else)",
)
async def livez() -> LivezPublic:
    return LivezPublic()


@router.get(
    "/health",
    response_model=HealthPublic,
    response_class=HealthJSONResponse,
    name="read_health",
    summary="Health of the data plane: 200 pass or warn, 503 fail",
    responses={
        503: {
            "model": HealthPublic,
            "description": "a check fails: not serving",
            "content": {HEALTH_MEDIA_TYPE: {}},
        }
    },
)
async def read_health(dp: DataPlaneDep, health: HealthDep) -> HealthJSONResponse:
    # on the event loop, not the threadpool: the checks only read flags (no locks, no I/O), and
    # health must answer even while every pool thread waits on a slow /status
    report = health.run()
    checks: dict[str, list[dict[str, Any]]] = {}
    for r in report.results:
        checks.setdefault(r.name, []).append(check_view(r))
    info = dp.server_info()
    body = {
        "status": report.status,
        "version": info.version,
        "service_id": info.server_id,
        "description": "kvwarden data plane",
        "output": report.first_problem,
        "checks": checks,
    }
    return HealthJSONResponse(body, status_code=503 if report.status == "fail" else 200)
