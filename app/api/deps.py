"""Annotated dependencies: the data plane, the health checker, the metrics registry, admin auth.

Everything a route needs comes from ``request.app.state`` (set by `app.main.create_app`): no
module-level state, so one process can hold many apps (the tests do).
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry

from app.core.coalesce import Coalescer
from app.core.health import HealthChecker
from app.core.status import StatusSnapshot
from dataplane.server.facade import DataPlaneView


def get_dataplane(request: Request) -> DataPlaneView:
    dp: DataPlaneView = request.app.state.dp
    return dp


def get_health(request: Request) -> HealthChecker:
    checker: HealthChecker = request.app.state.health
    return checker


def get_metrics_registry(request: Request) -> CollectorRegistry:
    registry: CollectorRegistry = request.app.state.metrics_registry
    return registry


def get_status_source(request: Request) -> Coalescer[StatusSnapshot]:
    source: Coalescer[StatusSnapshot] = request.app.state.status_source
    return source


DataPlaneDep = Annotated[DataPlaneView, Depends(get_dataplane)]
StatusSourceDep = Annotated[Coalescer[StatusSnapshot], Depends(get_status_source)]
HealthDep = Annotated[HealthChecker, Depends(get_health)]
MetricsRegistryDep = Annotated[CollectorRegistry, Depends(get_metrics_registry)]

bearer_scheme = HTTPBearer(
    auto_error=False,  # we answer 403 / 401 ourselves, with the contract's bodies and headers
    description="The server's admin token (setting admin_token / KVWARDEN_ADMIN_TOKEN).",
)


def _unauthorised(request: Request, who: str, detail: str, header: str) -> HTTPException:
    request.state.audit_who = who
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": header})


def require_admin(
    request: Request,
    dp: DataPlaneDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> None:
    """403 without a configured token; 401 (``WWW-Authenticate: Bearer``) on a missing or
    wrong one. The comparison is constant-time. The outcome goes to the audit line."""
    configured = dp.settings.admin_secret()
    expected = configured.get_secret_value() if configured is not None else ""
    if not expected:
        request.state.audit_who = "refused (no admin token configured)"
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "admin routes are disabled: the server has no admin token"
        )
    if credentials is None:
        raise _unauthorised(request, "refused (no bearer token)", "missing bearer token", "Bearer")
    given = credentials.credentials.encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, expected.encode("utf-8", "surrogateescape")):
        raise _unauthorised(
            request, "refused (wrong token)", "invalid bearer token", 'Bearer error="invalid_token"'
        )
    request.state.audit_who = "admin (token ok)"


AdminDep = Annotated[None, Depends(require_admin)]
