"""The API router: every concern's router, in a fixed order (the OpenAPI file follows it)."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.routes import cache, health, instances, lookup, metrics, status

api_router = APIRouter()
api_router.include_router(health.router)
api_router.include_router(status.router)
api_router.include_router(instances.router)
api_router.include_router(instances.admin_router)
api_router.include_router(metrics.router)
api_router.include_router(lookup.router)
api_router.include_router(cache.admin_router)
