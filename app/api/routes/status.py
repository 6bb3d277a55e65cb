"""`/status`: the server, its health, its tracked instances and its storage at a glance."""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.api.deps import DataPlaneDep, HealthDep
from app.core.status import encode_status, status_document
from app.models import StatusPublic

router = APIRouter(tags=["status"])


# A plain `def`: it runs on the threadpool, never on the event loop, because the snapshot
# accessors take module locks. The body is encoded directly (see app.core.status).
@router.get("/status", response_model=StatusPublic, name="read_status",
            summary="Server, health, tracked instances and storage")
def read_status(dp: DataPlaneDep, health: HealthDep) -> Response:
    doc, instances = status_document(dp, health.run())
    return Response(encode_status(doc, instances), media_type="application/json")
