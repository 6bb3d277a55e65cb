"""Builds the sidecar app: ``create_app(dp)``. No module-level state: one app per data plane."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator

from app.api.main import api_router
from app.core.coalesce import Coalescer
from app.core.health import DEFAULT_PROVIDERS, CheckProvider, HealthChecker
from app.core.metrics import DataPlaneStateCollector
from app.core.status import InstanceEncoder, build_snapshot
from dataplane import __version__
from dataplane.server.facade import DataPlaneView

TITLE = "kvwarden sidecar"
DESCRIPTION = (
    "HTTP sidecar of the kvwarden KV-cache server: liveness, health, status, "
    "tracked worker instances, admin reap and Prometheus metrics."
)
# latency buckets of the HTTP histogram: the routes answer in well under a millisecond to tens
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def operation_id(route: APIRoute) -> str:
    """Stable operation ids: ``<tag>-<route name>`` (e.g. ``instances-reap_instance``)."""
    return f"{route.tags[0]}-{route.name}" if route.tags else route.name


def create_app(dp: DataPlaneView, check_providers: Sequence[CheckProvider] = DEFAULT_PROVIDERS) -> FastAPI:
    app = FastAPI(
        title=TITLE, description=DESCRIPTION, version=__version__, generate_unique_id_function=operation_id
    )
    app.state.dp = dp
    health = HealthChecker(dp, check_providers)
    app.state.health = health
    encoder = InstanceEncoder()
    app.state.status_source = Coalescer(lambda: build_snapshot(dp, health, encoder))
    registry = CollectorRegistry()  # this app's own: never the global REGISTRY
    registry.register(DataPlaneStateCollector(dp, health))
    app.state.metrics_registry = registry
    Instrumentator(registry=registry, excluded_handlers=["/metrics"]).instrument(
        app, metric_namespace="kvwarden", latency_lowr_buckets=LATENCY_BUCKETS
    )
    app.include_router(api_router)
    return app
