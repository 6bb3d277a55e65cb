"""The management module: HELLO / GET_SERVER_INFO and PING (liveness signal)."""

from __future__ import annotations

import logging
from typing import Any

from dataplane.modules.base import Handler, HandlerKind, InstanceLivenessTarget, RequestContext
from dataplane.protocol import PROTOCOL_VERSION, Empty, MsgType, Ping
from dataplane.server import Server

logger = logging.getLogger(__name__)


class ManagementModule:
    name = "management"

    def __init__(self, server: Server, chunk_size: int,
                 targets: list[InstanceLivenessTarget] | None = None) -> None:
        self._server = server
        self.chunk_size = chunk_size
        self.targets: list[InstanceLivenessTarget] = list(targets or [])

    def handlers(self) -> dict[MsgType, Handler]:
        # PING runs on the loop: it is a dict lookup under leaf locks, nothing on the loop can
        # block, and answering it there keeps its latency within a few x a raw ZMQ round trip.
        return {
            MsgType.HELLO: Handler(HandlerKind.LOOP, self._hello),
            MsgType.GET_SERVER_INFO: Handler(HandlerKind.LOOP, self._hello),
            MsgType.PING: Handler(HandlerKind.LOOP, self._ping),
        }

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def close(self) -> None:
        return None

    def report_status(self) -> dict[str, Any]:
        return {}

    def server_info(self) -> dict[str, Any]:
        s = self._server
        return {
            "server_id": s.server_id,
            "boot_token": s.boot_token,
            "protocol_version": PROTOCOL_VERSION,
            "version": s.version,
            "chunk_size": self.chunk_size,
            "max_frame_bytes": s.max_frame_bytes,
        }

    def _hello(self, rctx: RequestContext, _: Empty) -> dict[str, Any]:
        return self.server_info()

    def _ping(self, rctx: RequestContext, p: Ping) -> dict[str, Any]:
        self._server.metrics.pings.inc()
        tracked: bool | None = None
        if p.instance_id is not None:
            tracked = False
            for t in self.targets:
                tracked = t.touch_instance(p.instance_id, rctx.conn_fd) or tracked
        return {"boot_token": self._server.boot_token, "tracked": tracked}
