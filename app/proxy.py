"""``kvwarden proxy``: a disaggregated prefill's two steps in front of two vLLM OpenAI servers, a
prefill engine (``kv_role`` ``kv_producer``) and a decode engine (``kv_consumer``), both with
kvwarden's connector on one kvwarden server (or on servers that share Redis or a file tier).

For ``POST /v1/completions`` and ``POST /v1/chat/completions``:

1. the request goes to the prefill server with one token to generate (``max_tokens``, and
   ``max_completion_tokens`` for chat), streaming off, and ``kv_transfer_params``
   ``{"do_remote_decode": true}``: the prefill computes the prompt, stores its chunks and
   answers with ``kv_transfer_params`` naming them (`dataplane.client.vllm.handoff`);
2. the request as the client sent it, with those ``kv_transfer_params``, goes to the decode
   server, whose answer (streamed, when asked) goes back to the client: it loads the prompt's
   chunks, waiting for them within its bound, and computes only the rest.

A prefill that fails (down, an error) is logged and the request goes to the decode server alone,
which computes the prompt itself: the client gets its answer either way. A body that is not a
JSON object is answered 400. ``GET /v1/models`` and ``GET /health`` are the decode server's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

logger = logging.getLogger(__name__)

TIMEOUT_S = 600.0  # a long prompt's prefill, a long answer's decode


def create_proxy_app(prefill: str, decode: str, timeout_s: float = TIMEOUT_S) -> FastAPI:
    """The proxy over the prefill server at ``prefill`` and the decode server at ``decode``
    (base URLs, such as ``http://127.0.0.1:8100``)."""
    app = FastAPI(title="kvwarden proxy", docs_url=None, redoc_url=None)
    client = httpx.AsyncClient(timeout=timeout_s)
    app.router.on_shutdown.append(client.aclose)

    async def handoff(request: Request, path: str, chat: bool) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return JSONResponse({"error": f"the body is not JSON: {exc}"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "the body is not a JSON object"}, status_code=400)
        params = await _prefill(client, prefill + path, body, chat)
        sent = dict(body)
        if params is not None:
            sent["kv_transfer_params"] = params
        if body.get("stream"):
            return await _stream(client, decode + path, sent)
        r = await client.post(decode + path, json=sent)
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handoff(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handoff(request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        r = await client.get(decode + "/v1/models")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        r = await client.get(decode + "/health")
        return Response(r.content, status_code=r.status_code)

    return app


async def _prefill(client: httpx.AsyncClient, url: str, body: dict[str, Any], chat: bool) -> Any:
    """The prefill step: its answer's ``kv_transfer_params``, or None when it failed."""
    step = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    step["max_tokens"] = 1
    if chat:
        step["max_completion_tokens"] = 1
    step["kv_transfer_params"] = {"do_remote_decode": True}
    try:
        r = await client.post(url, json=step)
    except httpx.HTTPError as exc:
        logger.warning("proxy: the prefill server failed (%s): the decode server computes the prompt", exc)
        return None
    if r.status_code != 200:
        logger.warning(
            "proxy: the prefill server answered %d: the decode server computes the prompt: %s",
            r.status_code,
            r.text[:200],
        )
        return None
    try:
        return r.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Response:
    """The decode server's streamed answer, passed on as it comes."""
    req = client.build_request("POST", url, json=body)
    r = await client.send(req, stream=True)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        finally:
            await r.aclose()

    return StreamingResponse(chunks(), status_code=r.status_code, media_type=r.headers.get("content-type"))
