"""`kvwarden proxy` (`app.proxy`): the two steps of a disaggregated prefill against two upstream
HTTP servers standing in for vLLM's (real servers on real sockets, which record what they get):
the prefill step asks one token and no stream, the decode step gets the client's request with
the prefill's ``kv_transfer_params``, its stream passes through, a failed prefill still gets an
answer from the decode server, and a bad body is refused. The proxy with real vLLM servers:
tests/e2e/test_vllm_handoff.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from app.cli import main
from app.proxy import create_proxy_app
from tests.helpers import free_port, wait_until

PARAMS = {"kvwarden": {"tokens": 512, "key": "ab", "server": "tcp://x:1"}}


class Upstream:
    """An app served by uvicorn on a free port, on a thread (the proxy, or an upstream that
    records the bodies it is sent)."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, what="the upstream server")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def prefill_app(got: list[dict[str, Any]], status: int = 200) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def step(request: Request) -> JSONResponse:
        got.append(await request.json())
        return JSONResponse({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS}, status_code=status)

    return app


def decode_app(got: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def step(request: Request) -> Any:
        body = await request.json()
        got.append(body)
        if body.get("stream"):
            return StreamingResponse(
                iter([b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]), media_type="text/event-stream"
            )
        return {"choices": [{"text": "decoded"}], "seen": body}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"data": [{"id": "m"}]}

    return app


@pytest.fixture
def upstreams() -> Iterator[tuple[Upstream, Upstream, list[dict[str, Any]], list[dict[str, Any]]]]:
    pre: list[dict[str, Any]] = []
    dec: list[dict[str, Any]] = []
    p, d = Upstream(prefill_app(pre)), Upstream(decode_app(dec))
    yield p, d, pre, dec
    p.stop()
    d.stop()


def test_a_completion_is_prefilled_with_one_token_then_decoded_with_the_prefills_params(
    upstreams: tuple[Upstream, Upstream, list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    p, d, pre, dec = upstreams
    proxy = Upstream(create_proxy_app(p.url, d.url))
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        assert pre == [{**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}]
        assert dec == [{**body, "kv_transfer_params": PARAMS}]
        chat = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 9,
        }
        r = client.post("/v1/chat/completions", json={**chat, "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.text == "data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert pre[1] == {
            "model": "m",
            "messages": chat["messages"],
            "max_tokens": 1,
            "max_completion_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }  # no stream to the prefill
        assert dec[1]["stream"] is True and dec[1]["kv_transfer_params"] == PARAMS
        assert client.get("/v1/models").json() == {"data": [{"id": "m"}]}
    proxy.stop()


def test_a_failed_prefill_still_gets_the_decode_servers_answer_and_a_bad_body_is_refused(
    upstreams: tuple[Upstream, Upstream, list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    _, d, _, dec = upstreams
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = Upstream(create_proxy_app(down, d.url))
    with httpx.Client(base_url=proxy.url, timeout=30) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 4})
        assert r.status_code == 200 and "kv_transfer_params" not in dec[0]  # computed by the decode engine
        r = client.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "not JSON" in r.json()["error"]
        r = client.post("/v1/completions", json=[1, 2])
        assert r.status_code == 400 and "not a JSON object" in r.json()["error"]
    proxy.stop()
    assert len(dec) == 1


def test_the_proxy_command_refuses_bad_urls(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["proxy", "--prefill", "localhost:8100", "--decode", "http://127.0.0.1:8200"]) == 2
    assert "--prefill 'localhost:8100': expected http://host:port" in capsys.readouterr().err
    assert main(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2/v1"]) == 2
    assert main(["proxy", "--prefill", "http://a:1", "--decode", "http://b:2", "--port", "0"]) == 2
