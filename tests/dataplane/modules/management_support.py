"""The management module's tests' plane (`test_management`, `test_management_connections`):
management modules wired as ``build_dataplane`` wires them, the transfer modules they watch, and
real server loops in this process (`Running`). The ``running`` fixture is in this directory's
``conftest.py``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from dataplane.liveness.release import InstanceReleaser
from dataplane.liveness.target import InstanceLivenessTarget
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import RequestContext, ServerInfo
from dataplane.modules.engine_pool import EngineDrivenTransferModule
from dataplane.modules.management import ManagementModule
from dataplane.modules.server_driven import ServerDrivenTransferModule
from dataplane.server.loop import Server
from dataplane.storage.l1 import L1Store
from dataplane.wire.messages import Message, MsgType, Ping
from dataplane.wire.protocol import PROTOCOL_VERSION, decode_reply, encode_message
from tests.dataplane.fakes import BlendLike
from tests.dataplane.registration import SECRET, engine_register_message, register_message

CHUNK = 16
T0 = 1000.0
BOOT_TOKEN = 0x5EED_B007
Caches = list[torch.Tensor]


def server_info(server: Server | None = None) -> ServerInfo:
    """The identity the assembler hands the module: a real server's, or a fixed one."""
    if server is None:
        return ServerInfo(
            "test-server", BOOT_TOKEN, "test", PROTOCOL_VERSION, T0, "tcp://127.0.0.1:0", CHUNK, 16 << 20
        )
    return server.info(CHUNK)


def management(
    targets: Sequence[InstanceLivenessTarget],
    metrics: DataPlaneMetrics,
    info: ServerInfo | None = None,
    **liveness: Any,
) -> ManagementModule:
    """A management module over ``targets``, wired as ``build_dataplane`` wires it: its identity
    and the one release path (an `InstanceReleaser` counting into ``metrics``)."""
    return ManagementModule(info or server_info(), InstanceReleaser(targets, metrics), metrics, **liveness)


def register(m: ServerDrivenTransferModule, instance_id: int, caches: Caches, conn_fd: int = 5) -> None:
    reg = register_message(instance_id, caches)
    m.handlers()[MsgType.REGISTER_KV_CACHE].fn(RequestContext(1, MsgType.REGISTER_KV_CACHE, conn_fd), reg)


def engine_register(m: EngineDrivenTransferModule, instance_id: int, conn_fd: int = 5) -> None:
    msg = engine_register_message(instance_id)
    m.handlers()[MsgType.ENGINE_REGISTER].fn(RequestContext(1, MsgType.ENGINE_REGISTER, conn_fd), msg)


def modules(
    clock: Callable[[], float] = time.monotonic, metrics: DataPlaneMetrics | None = None
) -> tuple[ServerDrivenTransferModule, EngineDrivenTransferModule]:
    l1, metrics = L1Store(8 << 20), metrics or DataPlaneMetrics()
    return (
        ServerDrivenTransferModule(l1, CHUNK, metrics, clock),
        EngineDrivenTransferModule(l1, CHUNK, metrics, clock),
    )


def ping_of(instance_id: int | None) -> Ping:
    """A PING of ``instance_id`` with its registrant's secret, or a probe (None)."""
    return Ping(instance_id, None if instance_id is None else SECRET)


def sample(metrics: DataPlaneMetrics, name: str, **labels: str) -> float:
    v = metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


@dataclass
class Running:
    server: Server
    management: ManagementModule
    transfer: ServerDrivenTransferModule
    engine: EngineDrivenTransferModule
    blend: BlendLike
    metrics: DataPlaneMetrics
    ctx: zmq.Context[Any]
    socks: list[zmq.Socket[Any]]
    closes: list[int]  # fds of the disconnects the loop delivered (after management saw them)

    def dealer(self) -> zmq.Socket[Any]:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.server.bound_endpoint)
        self.socks.append(s)
        return s

    def close_sockets(self) -> None:
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()


def call(sock: zmq.Socket[Any], rid: int, msg: Message, timeout: float = 10.0) -> Any:
    sock.send(encode_message(rid, msg))
    assert sock.poll(int(timeout * 1000), zmq.POLLIN), f"no reply to {msg.TYPE} within {timeout}s"
    reply = decode_reply(sock.recv())
    assert reply.request_id == rid
    assert reply.ok, reply.body
    return reply.body


def running_servers() -> Iterator[Callable[..., Running]]:
    """The body of the ``running`` fixture: real server loops in this process, assembled as
    ``build_dataplane`` assembles them, with the modules a test wants; stopped after the test."""
    made: list[Running] = []

    def make(
        transfer: ServerDrivenTransferModule | None = None,
        *,
        reap_timeout_s: float = 0.0,
        registration_grace_s: float = 3600.0,
        disconnect_grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> Running:
        metrics = DataPlaneMetrics()
        server = Server("tcp://127.0.0.1:*", metrics=metrics)
        sd, ed = modules(clock, metrics)
        sd = transfer or sd
        blend = BlendLike()
        mgmt = management(
            [sd.registry, ed.registry, blend],
            metrics,
            server_info(server),
            reap_timeout_s=reap_timeout_s,
            registration_grace_s=registration_grace_s,
            disconnect_grace_s=disconnect_grace_s,
            clock=clock,
        )
        closes: list[int] = []
        server.add_connection_listener(mgmt.on_connection)
        server.add_connection_listener(lambda fd, connected: None if connected else closes.append(fd))
        for m in (mgmt, sd, ed):
            server.add_module(m)
        server.start()
        r = Running(server, mgmt, sd, ed, blend, metrics, zmq.Context(), [], closes)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close_sockets()
        assert r.server.stop(5.0)
