"""`/status`: the server, its health, its tracked instances and its storage at a glance."""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.api.deps import StatusSourceDep
from app.models import StatusPublic

router = APIRouter(tags=["status"])


# A plain `def`: it runs on the threadpool, never on the event loop, because building takes the
# data plane's module locks (through its snapshot accessors) and may wait for a shared build.
# The body is encoded directly (see app.core.status).
@router.get(
    "/status",
    response_model=StatusPublic,
    name="read_status",
    summary="Server, health, tracked instances and storage",
)
def read_status(source: StatusSourceDep) -> Response:
    return Response(source.get().status_json, media_type="application/json")
