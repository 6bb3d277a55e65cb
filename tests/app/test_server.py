"""`Sidecar`: uvicorn on its own thread; bounded start and stop; the process's signals kept."""

from __future__ import annotations

import signal
import socket
import threading

import httpx
import pytest

from app.main import create_app
from app.server import Sidecar, SidecarStartError
from dataplane.server.runtime import DataPlane
from tests.helpers import free_port, wait_until


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


# The sidecar is built with a 1 s grace: stop() joins its thread for graceful_timeout_s + 2 s,
# then sets force_exit and joins 1 s more, so it returns by GRACE_S + 3 s whatever the server
# does. The tests check which of these paths a stop took (uvicorn's log, force_exit, whether the
# held handler had returned), never how long it took: the suite shares a 2-core machine.
GRACE_S = 1.0
STOP_BOUND_S = GRACE_S + 2.0 + 1.0
STOP_CEILING_S = STOP_BOUND_S + 5.0  # a failure guard for joins, never asserted
HOLD_LIMIT_S = 30.0  # a held request gives up by itself after this: nothing hangs for good


class HeldRequest:
    """A route, ``/hold``, served by the real app, that blocks until the test releases it, and
    one request to it from another thread: a request really in flight.

    ``on_loop``: the route blocks the event loop itself (an ``async def`` that waits) instead of
    a threadpool thread (a plain ``def``, like the sidecar's own routes)."""

    def __init__(self, dp: DataPlane, on_loop: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()  # set as the route's handler returns
        app = create_app(dp)

        def hold() -> dict[str, bool]:
            self.entered.set()
            try:
                return {"released": self.release.wait(HOLD_LIMIT_S)}
            finally:
                self.returned.set()

        async def hold_on_loop() -> dict[str, bool]:
            return hold()

        app.add_api_route("/hold", hold_on_loop if on_loop else hold)
        self.sidecar = Sidecar(dp, host="127.0.0.1", port=0, app=app, graceful_timeout_s=GRACE_S)
        self.sidecar.start()
        self.outcome: list[httpx.Response | httpx.HTTPError] = []
        self._client = threading.Thread(target=self._request, name="held-request")
        self._client.start()
        assert self.entered.wait(10), "the request never reached the route"

    def _request(self) -> None:
        try:
            self.outcome.append(httpx.get(self.sidecar.url + "/hold", timeout=HOLD_LIMIT_S + 10))
        except httpx.HTTPError as exc:
            self.outcome.append(exc)

    def finish(self) -> httpx.Response | httpx.HTTPError:
        """Release the route, and the request's outcome once the client thread ended."""
        self.release.set()
        self._client.join(HOLD_LIMIT_S + 15)
        assert not self._client.is_alive(), "the client thread is still waiting"
        (outcome,) = self.outcome
        return outcome

    def accepts_connections(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.sidecar.port), timeout=1).close()
        except ConnectionRefusedError:
            return False
        return True


GRACE_EXCEEDED = "timeout graceful shutdown exceeded"  # uvicorn's log as its grace ran out


def forced(sidecar: Sidecar) -> bool:
    """stop() gave up joining within its bound and set uvicorn's force_exit."""
    assert sidecar._server is not None
    return bool(sidecar._server.force_exit)


def stop_and_see(held: HeldRequest) -> tuple[bool, bool]:
    """stop() (the documented bound: graceful_timeout_s + 2 s, then force_exit); what it
    returned, and whether the held route's handler had returned by then."""
    stopped = held.sidecar.stop()
    return stopped, held.returned.is_set()


def test_stop_lets_a_request_in_flight_finish_within_the_grace(
    dp: DataPlane, caplog: pytest.LogCaptureFixture
) -> None:
    held = HeldRequest(dp)
    result: list[tuple[bool, bool]] = []
    stopper = threading.Thread(target=lambda: result.append(stop_and_see(held)), name="stopper")
    stopper.start()
    try:
        # the shutdown has begun (no new connection is accepted) with the request still held
        wait_until(lambda: not held.accepts_connections(), 10, what="the sidecar to stop accepting")
        assert not held.outcome
        assert stopper.is_alive()
    finally:
        outcome = held.finish()
        stopper.join(STOP_CEILING_S + 5)
    # the request in flight was answered, and stop() returned True only after its handler had
    # returned: the shutdown waited for it, and did not cut it
    assert isinstance(outcome, httpx.Response), outcome
    assert (outcome.status_code, outcome.json()) == (200, {"released": True})
    ((stopped, handler_done),) = result
    assert stopped is True and handler_done is True
    assert GRACE_EXCEEDED not in caplog.text
    assert not held.sidecar.is_alive()


def test_stop_cuts_a_request_that_outlasts_the_grace(dp: DataPlane, caplog: pytest.LogCaptureFixture) -> None:
    held = HeldRequest(dp)
    try:
        stopped, handler_done = stop_and_see(held)
    finally:
        outcome = held.finish()
    # the request had its grace, then uvicorn cancelled it (its log says so) and the thread
    # ended: True, with the handler still blocked (stop() did not wait for the held request)
    assert stopped is True and handler_done is False
    assert GRACE_EXCEEDED in caplog.text
    assert not held.sidecar.is_alive()
    # the handler never returned in time: whatever the client got (uvicorn answers the cancelled
    # request 500, or the connection drops), it was no success
    assert not (isinstance(outcome, httpx.Response) and outcome.is_success), outcome


def test_stop_gives_up_after_its_bound_when_the_event_loop_is_blocked(
    dp: DataPlane, caplog: pytest.LogCaptureFixture
) -> None:
    held = HeldRequest(dp, on_loop=True)
    try:
        stopped, handler_done = stop_and_see(held)
        # nothing on the loop runs, so neither the grace nor force_exit can end the thread:
        # stop() waited the whole bound, forced the exit, waited the forced second, says False
        assert stopped is False and handler_done is False
        assert forced(held.sidecar)
        assert held.sidecar.is_alive()
        assert f"sidecar: HTTP thread still alive {STOP_BOUND_S:.1f}s after stop" in caplog.text
    finally:
        held.finish()
    # released, the loop runs again and the thread ends
    wait_until(lambda: not held.sidecar.is_alive(), 10, what="the HTTP thread to end")


def test_stop_closes_an_idle_kept_alive_connection(dp: DataPlane, caplog: pytest.LogCaptureFixture) -> None:
    sidecar = Sidecar(dp, host="127.0.0.1", port=0, graceful_timeout_s=GRACE_S)
    sidecar.start()
    with httpx.Client(base_url=sidecar.url, timeout=10) as client:
        assert client.get("/livez").status_code == 200  # the connection stays open, idle
        stopped = sidecar.stop()
        # an idle connection does not hold the stop up (uvicorn never waited out its grace for
        # it), and it is closed
        assert stopped is True
        assert GRACE_EXCEEDED not in caplog.text
        with pytest.raises(httpx.TransportError):
            client.get("/livez")
