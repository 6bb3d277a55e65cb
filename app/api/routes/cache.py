"""`POST /v1/cache/clear`: an operator removes a model's chunks from every tier (admin)."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, status
from fastapi.responses import JSONResponse

from app.api.audit import AuditedRoute
from app.api.deps import AdminDep, DataPlaneDep
from app.models import CacheClear, CacheCleared, Detail

# an admin route: every call leaves one audit line (app.api.audit)
admin_router = APIRouter(prefix="/v1/cache", tags=["cache"], route_class=AuditedRoute)


@admin_router.post(
    "/clear",
    response_model=CacheCleared,
    name="clear_cache",
    summary="Remove a model's chunks from every tier, or a tenant's or an adapter's (admin)",
    description="What an engine's reset of its cache does (vLLM's reset_prefix_cache with "
    "reset_external), for an operator: every chunk of the model's scopes (each layout and rank "
    "its instances registered since the server started), under every salt and adapter, "
    "leaves L1, the file tier and the remote tier, chunks being written included; with `salt`, "
    "`adapter` or both, only the chunks stored under them. KV events announce the removals. "
    "Answered once done: 200 when nothing of it is left, 503 when a tier could not be cleared "
    "(down, an error) or a chunk stayed held by a reader, with what was removed.",
    responses={
        401: {"model": Detail, "description": "missing or wrong bearer token"},
        403: {"model": Detail, "description": "no admin token is configured"},
        404: {
            "model": Detail,
            "description": "no instance of the model registered since start, or no chunk of the "
            "adapter stored since start (its namespace is not known)",
        },
        503: {"model": CacheCleared, "description": "a tier could not be cleared, or a chunk stayed pinned"},
    },
)
def clear_cache(
    request: Request, _: AdminDep, dp: DataPlaneDep, body: CacheClear
) -> CacheCleared | JSONResponse:
    client = request.client
    who = f"admin from {client.host}:{client.port}" if client is not None else "admin"
    # blocking (the disk, Redis): this sync route runs on the threadpool, never the loop
    what = f"model {body.model!r}" + (", one salt" if body.salt else "")  # (never the salt itself)
    what += f", adapter {body.adapter!r}" if body.adapter else ""
    try:
        got = dp.clear_model(body.model, who, body.salt, body.adapter)
    except LookupError as exc:
        request.state.audit_result = f"{what}: adapter not known"
        raise HTTPException(status.HTTP_404_NOT_FOUND, str(exc)) from None
    if not got.scopes:
        request.state.audit_result = f"model {body.model!r}: not registered since start"
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"no instance of model {body.model!r} registered since this server started: it knows "
            "no scope of it to clear",
        )
    out = CacheCleared(
        model=body.model,
        scopes=got.scopes,
        removed=got.removed,
        l1=got.l1,
        fs=got.fs,
        remote=got.remote,
        pinned=got.pinned,
        failed=list(got.failed),
        complete=got.complete,
    )
    request.state.audit_result = f"{what}: removed {got.removed}" + (
        "" if got.complete else f", incomplete (failed: {','.join(got.failed) or '-'}, pinned {got.pinned})"
    )
    if not got.complete:
        return JSONResponse(out.model_dump(), status_code=status.HTTP_503_SERVICE_UNAVAILABLE)
    return out
