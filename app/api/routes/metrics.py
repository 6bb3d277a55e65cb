"""`/metrics`: Prometheus text format over the data plane's and the app's registries."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.api.deps import DataPlaneDep, MetricsRegistryDep
from app.core.metrics import render_metrics

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    name="read_metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "Prometheus text exposition format",
        }
    },
)
def read_metrics(dp: DataPlaneDep, registry: MetricsRegistryDep) -> Response:
    return Response(render_metrics(dp, registry), media_type=CONTENT_TYPE_LATEST)
