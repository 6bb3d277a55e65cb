"""Audit of admin calls: one WARNING line per call, whatever its outcome.

A route class rather than a dependency, because the outcome is known only after the handler
ran or raised (401/403 from auth, 422 from validation, 404, 200, or a server error):
``audit: admin reap_instance who=... from=host:port instance=... dry_run=... outcome=...``.

Refused calls (401, 403, 422: anybody can make them, as fast as they like) go through the log
rate limiter of `app.logs` like any other line, so a flood of them cannot flood the log: past the
limit they are counted in one ``suppressed K similar messages`` line. Every other call (one that
got past the token check) is marked never to be suppressed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from app.logs import NO_RATE_LIMIT

REFUSED = frozenset({401, 403, 422})

logger = logging.getLogger(__name__)


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class AuditedRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        name = self.name

        async def audited(request: Request) -> Response:
            status_code = 500
            try:
                response = await handler(request)
                status_code = response.status_code
                return response
            except HTTPException as exc:
                status_code = exc.status_code
                raise
            except RequestValidationError:
                status_code = 422
                raise
            finally:
                client = request.client
                where = f"{client.host}:{client.port}" if client is not None else "unknown"
                result = getattr(request.state, "audit_result", "")
                logger.warning(
                    "audit: admin %s who=%s from=%s instance=%s dry_run=%s outcome=%d%s",
                    name,
                    getattr(request.state, "audit_who", "unchecked"),
                    where,
                    _short(request.path_params.get("instance_id")),
                    _short(request.query_params.get("dry_run", "false")),
                    status_code,
                    f" ({result})" if result else "",
                    extra={NO_RATE_LIMIT: status_code not in REFUSED},
                )

        return audited
