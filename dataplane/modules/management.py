"""The management module: HELLO / GET_SERVER_INFO, PING, and the worker reaper.

PING carries the worker's instance id and touches every liveness target; its reply carries the
server's boot token (random per start) and whether the id is tracked, so a client notices a
restarted server or its own reaping on its next PING. The reaper thread reaps instances that
fell silent (``reap_timeout`` once they pinged, ``registration_grace`` before) and those whose
connection closed more than ``disconnect_grace`` ago, then fans the ids out to
``drop_instance_state`` on every target.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from dataplane.modules.base import Handler, HandlerKind, InstanceLivenessTarget, RequestContext
from dataplane.protocol import PROTOCOL_VERSION, Empty, InstanceOnly, MsgType, Ping
from dataplane.server import Server

logger = logging.getLogger(__name__)


class WorkerReaper:
    """The reaper thread: ``reap_once`` is the pure step; the thread only paces it.

    It runs every ``reap_timeout / 4`` and, while a disconnected instance waits out its grace,
    wakes at that deadline, so a dead peer goes within ``disconnect_grace`` plus one step.
    """

    def __init__(self, targets: list[InstanceLivenessTarget], reap_timeout_s: float,
                 registration_grace_s: float, disconnect_grace_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 on_reaped: Callable[[list[int]], None] | None = None) -> None:
        if not reap_timeout_s > 0:
            raise ValueError("the reaper needs a positive reap timeout")
        self.targets = targets
        self.reap_timeout_s = reap_timeout_s
        self.registration_grace_s = registration_grace_s
        self.disconnect_grace_s = disconnect_grace_s
        self.interval_s = reap_timeout_s / 4
        self._clock = clock
        self._on_reaped = on_reaped
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._lock = threading.Lock()  # guards _disconnect_deadlines and _closed
        self._disconnect_deadlines: list[float] = []
        self._closed: list[tuple[int, float]] = []  # (fd, when) closes not yet marked
        self._thread: threading.Thread | None = None

    def reap_once(self) -> list[int]:
        ids: list[int] = []
        for t in self.targets:  # one failing target never keeps the others from being reaped
            try:
                ids.extend(t.reap_stale_instances(self.reap_timeout_s, self.registration_grace_s))
                if self.disconnect_grace_s > 0:
                    ids.extend(t.reap_disconnected_instances(self.disconnect_grace_s))
            except Exception:
                logger.exception("reaper: reaping %s failed", getattr(t, "name", t))
        if ids:
            for t in self.targets:
                for iid in ids:
                    try:
                        t.drop_instance_state(iid)
                    except Exception:
                        logger.exception("reaper: drop_instance_state(%d) failed", iid)
            if self._on_reaped is not None:
                self._on_reaped(ids)
        return ids

    def note_disconnect(self, now: float) -> None:
        """A connection closed at ``now``: wake once its grace is over."""
        if self.disconnect_grace_s <= 0:
            return
        with self._lock:
            self._disconnect_deadlines.append(now + self.disconnect_grace_s)
        self._kick.set()

    def note_closed(self, conn_fd: int, now: float) -> None:
        """The loop saw connection ``conn_fd`` close at ``now``: this thread flags the instances
        last seen over it (a scan of every entry, kept off the loop), then waits out the grace."""
        if self.disconnect_grace_s <= 0:
            return
        with self._lock:
            self._closed.append((conn_fd, now))
        self._kick.set()

    def _mark_closed(self) -> None:
        with self._lock:
            closed, self._closed = self._closed, []
        for fd, now in closed:
            marked = 0
            for t in self.targets:
                try:
                    marked += t.mark_connection_closed(fd, now)
                except Exception:
                    logger.exception("reaper: marking fd %d closed failed", fd)
            if marked:
                logger.info("liveness: connection fd %d closed; %d instance(s) reaped in %.1fs "
                            "unless they reconnect", fd, marked, self.disconnect_grace_s)
                self.note_disconnect(now)

    def _next_wait(self) -> float:
        now = self._clock()
        with self._lock:
            self._disconnect_deadlines = [d for d in self._disconnect_deadlines if d + 0.05 > now]
            soonest = min(self._disconnect_deadlines, default=None)
        wait = self.interval_s
        if soonest is not None:
            wait = min(wait, max(0.0, soonest - now) + 0.05)
        return wait

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvwarden-worker-reaper",
                                        daemon=True)
        self._thread.start()
        logger.info("reaper: started (timeout %.1fs, grace %.1fs, disconnect grace %.1fs, "
                    "every %.1fs)", self.reap_timeout_s, self.registration_grace_s,
                    self.disconnect_grace_s, self.interval_s)

    def _run(self) -> None:
        while True:
            self._kick.wait(self._next_wait())
            self._kick.clear()
            if self._stop.is_set():
                return
            try:
                self._mark_closed()
                self.reap_once()
            except Exception:
                logger.exception("reaper: cycle failed")

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()

    def join(self, timeout_s: float = 5.0) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("reaper: thread still alive after %.1fs", timeout_s)
            return False
        return True

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class ManagementModule:
    name = "management"

    def __init__(self, server: Server, chunk_size: int,
                 targets: list[InstanceLivenessTarget] | None = None, *,
                 reap_timeout_s: float = 0.0, registration_grace_s: float = 3600.0,
                 disconnect_grace_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._server = server
        self.chunk_size = chunk_size
        self.targets: list[InstanceLivenessTarget] = list(targets or [])
        self.reap_timeout_s = reap_timeout_s
        self.registration_grace_s = registration_grace_s
        self.disconnect_grace_s = disconnect_grace_s
        self._clock = clock
        self._lock = threading.Lock()  # guards reaped_total
        self.reaped_total = 0
        for t in self.targets:
            t.reap_listener = self._count_reap
        self.reaper: WorkerReaper | None = None
        if reap_timeout_s > 0:
            self.reaper = WorkerReaper(self.targets, reap_timeout_s, registration_grace_s,
                                       disconnect_grace_s, clock)
        server.add_connection_listener(self._on_connection)

    def handlers(self) -> dict[MsgType, Handler]:
        # PING runs on the loop: it is a dict lookup under leaf locks, nothing on the loop can
        # block, and answering it there keeps its latency within a few x a raw ZMQ round trip.
        return {
            MsgType.HELLO: Handler(HandlerKind.LOOP, self._hello),
            MsgType.GET_SERVER_INFO: Handler(HandlerKind.LOOP, self._hello),
            MsgType.PING: Handler(HandlerKind.LOOP, self._ping),
            MsgType.UNREGISTER_KV_CACHE: Handler(HandlerKind.NORMAL, self._unregister),
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

    # ---------------------------------------------------------------- status
    def report_status(self) -> dict[str, Any]:
        if not self.targets:
            return {}
        with self._lock:
            reaped = self.reaped_total
        return {
            "worker_liveness": {
                "enabled": self.reaper is not None,
                "reap_timeout_seconds": self.reap_timeout_s,
                "registration_grace_seconds": self.registration_grace_s,
                # disconnect reaping needs the reaper: with reaping off it is off too
                "disconnect_grace_seconds": self.disconnect_grace_s if self.reaper else 0.0,
                "tracked_instances": sum(t.tracked_instance_count() for t in self.targets),
                "reaped_total": reaped,
            }
        }

    def reaper_alive(self) -> bool | None:
        """None when reaping is disabled."""
        return None if self.reaper is None else self.reaper.is_alive()

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

    # ------------------------------------------------------------------ admin
    def release_instance(self, instance_id: int, why: str) -> list[str]:
        """The one cleanup path (UNREGISTER, admin reap): remove from every target, then fan
        out ``drop_instance_state``. Returns the names of the targets that held it."""
        released: list[str] = []
        for t in self.targets:
            if t.remove_instance(instance_id, why):
                released.append(str(getattr(t, "name", type(t).__name__)))
        for t in self.targets:
            try:
                t.drop_instance_state(instance_id)
            except Exception:
                logger.exception("management: drop_instance_state(%d) failed", instance_id)
        return released

    def force_reap(self, instance_id: int) -> list[str]:
        """Admin reap: the cleanup UNREGISTER runs, counted as reason ``admin``."""
        released = self.release_instance(instance_id, "admin")
        if released:
            self._count_reap(instance_id, "admin", 0.0, False)
        return released

    # ------------------------------------------------------------- internals
    def _count_reap(self, instance_id: int, reason: str, silence_s: float, pinged: bool) -> None:
        with self._lock:
            self.reaped_total += 1
        self._server.metrics.reaped.labels(reason=reason).inc()

    def _on_connection(self, fd: int, connected: bool) -> None:
        if connected or self.disconnect_grace_s <= 0 or self.reaper is None:
            return
        self.reaper.note_closed(fd, self._clock())  # the scan runs on the reaper thread

    def _unregister(self, rctx: RequestContext, p: InstanceOnly) -> dict[str, Any]:
        return {"removed": bool(self.release_instance(p.instance_id, "unregister"))}

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
