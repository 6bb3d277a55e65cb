"""Tracked worker instances: list, one, and the admin reap."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Query, Request, Response, status

from app.api.audit import AuditedRoute
from app.api.deps import AdminDep, DataPlaneDep, StatusSourceDep
from app.core.status import find_instance
from app.models import Detail, InstancePublic, ReapResult

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/instances", tags=["instances"])
# admin routes: every call leaves one audit line (app.api.audit)
admin_router = APIRouter(prefix="/instances", tags=["instances"], route_class=AuditedRoute)

InstanceId = Annotated[int, Path(ge=0, lt=1 << 63, description="63-bit instance id")]
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": Detail, "description": "the id is not tracked"},
}


@router.get("", response_model=list[InstancePublic], name="list_instances", summary="Every tracked instance")
def list_instances(source: StatusSourceDep) -> Response:
    return Response(source.get().instances_json, media_type="application/json")


@router.get(
    "/{instance_id}",
    response_model=InstancePublic,
    name="read_instance",
    summary="One tracked instance",
    responses=NOT_FOUND,
)
def read_instance(dp: DataPlaneDep, instance_id: InstanceId) -> InstancePublic:
    view = find_instance(dp, instance_id)
    if view is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"instance {instance_id} is not tracked")
    return InstancePublic.model_validate(view)


@admin_router.post(
    "/{instance_id}/reap",
    response_model=ReapResult,
    name="reap_instance",
    summary="Release an instance now (admin)",
    description="Runs the cleanup UNREGISTER and the reaper run, fans out drop_instance_state "
    'and counts kvwarden_instances_reaped_total{reason="admin"}. With '
    "`dry_run=true` only reports what would be released.",
    responses={
        401: {"model": Detail, "description": "missing or wrong bearer token"},
        403: {"model": Detail, "description": "no admin token is configured"},
        **NOT_FOUND,
    },
)
def reap_instance(
    request: Request,
    _: AdminDep,
    dp: DataPlaneDep,
    instance_id: InstanceId,
    dry_run: Annotated[bool, Query(description="report without releasing")] = False,
) -> ReapResult:
    if dry_run:
        released = dp.holders_of(instance_id)
        reaped = False
    else:
        # the same cleanup as UNREGISTER and the reaper; bounded, so fine on the threadpool
        released = dp.force_reap(instance_id)
        reaped = bool(released)
    if not released:
        request.state.audit_result = "not tracked"
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"instance {instance_id} is not tracked")
    request.state.audit_result = ("would release " if dry_run else "released ") + ",".join(released)
    return ReapResult(instance_id=instance_id, reaped=reaped, dry_run=dry_run, released=released)
