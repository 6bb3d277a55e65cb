"""The management module: HELLO / GET_SERVER_INFO, PING, UNREGISTER, and the worker reaper.

PING carries the worker's instance id and touches every liveness target; its reply carries the
server's boot token (random per start) and whether the id is tracked, so a client notices a
restarted server or its own reaping on its next PING. UNREGISTER and the admin reap go down the
one release path (`dataplane.liveness.release`); the reaper thread, which this module owns and
starts, does too. The module is handed what it needs: the server's identity (`ServerInfo`) and
the release path; the assembler subscribes ``on_connection`` to the loop's connection events.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dataplane.liveness.reaper import WorkerReaper
from dataplane.liveness.release import InstanceReleaser
from dataplane.metrics import DataPlaneMetrics
from dataplane.modules.base import Handler, RequestContext, ServerInfo
from dataplane.wire.messages import Hello, MsgType, Ping, Unregister
from dataplane.wire.replies import PingReply, ServerHello, Unregistered


class ManagementModule:
    name = "management"

    def __init__(
        self,
        info: ServerInfo,
        releaser: InstanceReleaser,
        metrics: DataPlaneMetrics,
        *,
        reap_timeout_s: float = 0.0,
        registration_grace_s: float = 3600.0,
        disconnect_grace_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.info = info
        self.releaser = releaser
        self._metrics = metrics
        self.reap_timeout_s = reap_timeout_s
        self.registration_grace_s = registration_grace_s
        # disconnect reaping needs the reaper: with reaping off it is off too
        self.disconnect_grace_s = disconnect_grace_s if reap_timeout_s > 0 else 0.0
        self._clock = clock
        self.reaper: WorkerReaper | None = None
        if reap_timeout_s > 0:
            self.reaper = WorkerReaper(
                releaser, reap_timeout_s, registration_grace_s, self.disconnect_grace_s, clock
            )
        self._hello_body = info.hello_body()

    def handlers(self) -> dict[MsgType, Handler]:
        # PING runs on the loop: it is a dict lookup under leaf locks, nothing on the loop can
        # block, and answering it there keeps its latency within a few x a raw ZMQ round trip.
        return {
            MsgType.HELLO: Handler(self._hello),
            MsgType.GET_SERVER_INFO: Handler(self._hello),
            MsgType.PING: Handler(self._ping),
            MsgType.UNREGISTER_KV_CACHE: Handler(self._unregister),
        }

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.reaper is not None:
            self.reaper.start()

    def stop(self) -> None:
        """Stop and join the reaper: it must be gone before any module clears its state."""
        if self.reaper is not None:
            self.reaper.stop()
            self.reaper.join()

    def close(self) -> None:
        return None

    def reaper_alive(self) -> bool | None:
        """None when reaping is disabled."""
        return None if self.reaper is None else self.reaper.is_alive()

    # ------------------------------------------------------------------ admin
    def force_reap(self, instance_id: int) -> list[str]:
        """Admin reap: the one release path, counted as reason ``admin``. The names of the
        targets that held the instance (empty: it was not tracked)."""
        return list(self.releaser.release([instance_id], "admin").get(instance_id, ()))

    def on_connection(self, fd: int, connected: bool) -> None:
        """A peer connected or disconnected (called on the loop thread: must not block)."""
        if not connected and self.reaper is not None and self.disconnect_grace_s > 0:
            self.reaper.note_closed(fd, self._clock())  # the scan runs on the reaper thread

    # --------------------------------------------------------------- handlers
    def _unregister(self, rctx: RequestContext, p: Unregister) -> Unregistered:
        for t in self.releaser.targets:  # only the owner unregisters (the admin route reaps)
            t.check_owner(p.instance_id, p.secret)
        held = self.releaser.release([p.instance_id], "unregister")
        return Unregistered(p.instance_id in held)

    def _hello(self, rctx: RequestContext, _: Hello) -> ServerHello:
        return self._hello_body

    def _ping(self, rctx: RequestContext, p: Ping) -> PingReply:
        self._metrics.pings.inc()
        tracked: bool | None = None
        if p.instance_id is not None:
            tracked = False
            for t in self.releaser.targets:
                tracked = t.touch_instance(p.instance_id, rctx.conn_fd, p.secret) or tracked
        return PingReply(self.info.boot_token, tracked)
