"""`/health` fails (503, status fail) for each dead part of the data plane alone: a real data plane
from `build_dataplane`, served by the real sidecar, with one of its threads gone.

- The loop thread dies: a liveness target (``build_dataplane(extra_targets=...)``, the seam the
  assembler offers) whose ``touch_instance`` raises a BaseException that is not an Exception.
  The real PING handler runs on the loop and touches every target; the handler wrapper catches
  only Exception, so the loop thread ends and records ``loop_error``.
- The reaper thread stops (``reaper.stop(); reaper.join()``) while the loop serves on.

Each time only the dead part's check fails; the other checks still pass and `/livez` answers.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import zmq
from pydantic import SecretStr

from app.models import HealthPublic
from dataplane.liveness.target import InstanceLivenessTarget
from dataplane.server.config import Settings
from dataplane.server.runtime import DataPlane, build_dataplane
from dataplane.wire.messages import Ping
from dataplane.wire.protocol import encode_message
from tests.app.conftest import CHUNK, TOKEN, AppFactory, DataPlaneFactory
from tests.conftest import DealerFactory
from tests.helpers import free_port, next_rid, ping, wait_until

CHECKS = {"dataplane:loop", "dataplane:pools", "dataplane:reaper"}
FATAL_ID = 424242  # a PING with this id kills the loop


class LoopKiller(BaseException):
    """Not an Exception: what a handler wrapper catching Exception lets through."""


class FatalTarget(InstanceLivenessTarget):
    """A liveness target whose touch of one id raises `LoopKiller` (on the loop thread)."""

    name = "fatal"

    def touch_instance(self, instance_id: int, conn_fd: int = -1, secret: bytes | None = None) -> bool:
        if instance_id == FATAL_ID:
            raise LoopKiller(f"touch of {instance_id}")
        return False


@pytest.fixture
def fatal_dp() -> Iterator[DataPlane]:
    """A started data plane with a `FatalTarget` among its liveness targets; stopped at teardown."""
    settings = Settings(
        port=free_port(), http_port=free_port(), chunk_size=CHUNK, admin_token=SecretStr(TOKEN)
    )
    dp = build_dataplane(settings, extra_targets=[FatalTarget()])
    dp.start()
    yield dp
    assert dp.stop(), "data plane did not stop within its bound"


def checks_of(r: httpx.Response) -> dict[str, tuple[str, str]]:
    body = HealthPublic.model_validate(r.json())
    return {name: (cs[0].status, cs[0].output) for name, cs in body.checks.items()}


def assert_fails_only(c: httpx.Client, dead: str, output: str) -> None:
    """/health is 503 fail, ``dead`` fails naming ``output``, every other check passes."""
    r = c.get("/health")
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/health+json")
    assert r.json()["status"] == "fail"
    checks = checks_of(r)
    assert set(checks) == CHECKS
    status, text = checks[dead]
    assert status == "fail" and output in text, checks[dead]
    assert {name: s for name, (s, _) in checks.items() if name != dead} == dict.fromkeys(
        CHECKS - {dead}, "pass"
    )
    assert r.json()["output"].startswith(dead)
    assert c.get("/livez").json() == {"status": "pass"}


def test_health_fails_naming_the_loop_when_the_loop_thread_dies(
    fatal_dp: DataPlane, serve_app: AppFactory, make_dealer: DealerFactory
) -> None:
    dp = fatal_dp
    c = serve_app(dp)
    sock = make_dealer(dp.server.bound_endpoint)
    ping(sock, FATAL_ID - 1)  # other ids pass through the target: the loop serves
    r = c.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "pass", r.text

    sock.send(encode_message(next_rid(), Ping(FATAL_ID, bytes(16))))
    wait_until(lambda: not dp.server.is_alive(), 30.0, what="the loop thread to die")
    comp = dp.components()
    assert comp.loop_error is not None and "LoopKiller" in comp.loop_error, comp
    assert comp.loop_alive is False
    assert comp.state == "running"  # it died: nobody stopped it
    assert comp.pools_alive is True and comp.reaper_alive is True
    assert not sock.poll(0, zmq.POLLIN)  # the fatal PING got no reply

    assert_fails_only(c, "dataplane:loop", "loop thread died: LoopKiller(")


def test_health_fails_naming_the_reaper_when_the_reaper_thread_stops(
    make_dp: DataPlaneFactory, serve_app: AppFactory, make_dealer: DealerFactory
) -> None:
    dp = make_dp()
    c = serve_app(dp)
    assert c.get("/health").status_code == 200
    reaper = dp.management.reaper
    assert reaper is not None
    reaper.stop()
    assert reaper.join()
    assert dp.components().reaper_alive is False

    assert_fails_only(c, "dataplane:reaper", "worker reaper thread is not running")
    ping(make_dealer(dp.server.bound_endpoint))  # the loop itself still serves
