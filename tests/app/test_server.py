"""`Sidecar`: uvicorn on its own thread; bounded start and stop; the process's signals kept."""

from __future__ import annotations

import signal
import socket

import httpx
import pytest

from app.server import Sidecar, SidecarStartError
from dataplane.server.runtime import DataPlane
from tests.helpers import free_port


def test_start_serves_and_stop_releases_the_port(dp: DataPlane) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    port = free_port()
    sidecar = Sidecar(dp, host="127.0.0.1", port=port)
    sidecar.start()
    try:
        assert sidecar.is_alive()
        assert sidecar.url == f"http://127.0.0.1:{port}"
        assert httpx.get(sidecar.url + "/livez", timeout=10).json() == {"status": "pass"}
        # the main thread keeps its handlers: uvicorn installed none
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        assert sidecar.stop(timeout_s=10)
    assert not sidecar.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(sidecar.url + "/livez", timeout=5)
    # the port is free again
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_defaults_come_from_the_settings(dp: DataPlane) -> None:
    sidecar = Sidecar(dp)
    assert (sidecar.host, sidecar.port) == (dp.settings.http_host, dp.settings.http_port)
    sidecar.start()
    try:
        r = httpx.get(f"http://127.0.0.1:{dp.settings.http_port}/status", timeout=10)
        assert r.json()["server"]["server_id"] == dp.server.server_id
    finally:
        assert sidecar.stop()


def test_a_port_in_use_fails_the_start_with_the_address(dp: DataPlane) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        sidecar = Sidecar(dp, host="127.0.0.1", port=port)
        with pytest.raises(
            SidecarStartError, match=f"^cannot listen on http://127.0.0.1:{port}: Address already in use$"
        ):
            sidecar.start()
        assert not sidecar.is_alive()
        assert sidecar.stop()


def test_stop_with_a_request_in_flight_is_bounded(dp: DataPlane) -> None:
    sidecar = Sidecar(dp, host="127.0.0.1", port=0, graceful_timeout_s=1.0)
    sidecar.start()
    client = httpx.Client(base_url=sidecar.url, timeout=10)
    assert client.get("/livez").status_code == 200  # a kept-alive connection stays open
    assert sidecar.stop(timeout_s=5)
    client.close()
