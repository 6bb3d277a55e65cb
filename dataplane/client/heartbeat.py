"""The worker's heartbeat: PINGs with its instance id, its health, and recovery.

``beat()`` is the pure step (one PING and its consequences); the ``kvwarden-heartbeat`` thread
only paces it (``while not stop.wait(interval)``). Health starts healthy, so the first transfer
is not gated. A failed PING marks the worker unhealthy. A changed boot token (the server
restarted) or ``tracked: false`` (the server reaped us) triggers ``recover`` at once, and an
unhealthy worker calls it on its next good PING: ``recover`` re-registers (a no-op refresh when
the server still holds the entry) and returns whether it worked; it must never raise. Health is
set only after it succeeded. Once ``stop()`` was called, nothing is recovered any more: no
late beat can rebuild a ghost registration. Health may also be cleared from outside
(``set_health(False)``: the adapter does when its transfer channel lost its connection, while
the thread is ``running``); recovery stays here, on the next good PING. ``set_health`` may be
called from several threads: each change is logged and reported once. ``_lock`` guards
``_boot_token``, ``_unhealthy_since`` and the changes of ``healthy``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from dataplane.wire.errors import KVWardenError
from dataplane.wire.replies import PingReply

logger = logging.getLogger(__name__)


class Heartbeat:
    def __init__(
        self,
        ping: Callable[[], PingReply],
        recover: Callable[[], bool],
        registered: Callable[[], bool],
        interval_s: float,
        on_health_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ping = ping  # one PING with our id; its reply body (raises on failure)
        self._recover = recover
        self._registered = registered
        self.interval_s = interval_s
        self._on_health_change = on_health_change
        self._clock = clock
        self.healthy = threading.Event()
        self.healthy.set()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _boot_token and _unhealthy_since
        self._boot_token: int | None = None
        self._unhealthy_since: float | None = None
        self._thread: threading.Thread | None = None

    @property
    def boot_token(self) -> int | None:
        with self._lock:
            return self._boot_token

    def adopt(self, boot_token: int) -> None:
        """The boot token of the server we registered with."""
        with self._lock:
            self._boot_token = boot_token

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def running(self) -> bool:
        """The thread runs and was not told to stop: a health lost now, it will try to win back."""
        t = self._thread
        return t is not None and t.is_alive() and not self._stop.is_set()

    # -------------------------------------------------------------------- step
    def beat(self) -> None:
        """One PING and its consequences (public so tests can drive it without the thread)."""
        try:
            reply = self._ping()
        except (KVWardenError, zmq.ZMQError) as exc:
            if not self._stop.is_set() and self.healthy.is_set():
                logger.warning("kvwarden client: PING failed (%s): unhealthy", exc)
                self.set_health(False)
            return
        if self._stop.is_set():
            return
        token = reply.boot_token
        known = self.boot_token
        reason = None
        if known is not None and token != known:
            reason = f"server restarted (boot token {known} -> {token})"
        elif self._registered() and reply.tracked is False:
            reason = "server no longer tracks this instance"
        if reason is None and self.healthy.is_set():
            return
        if reason:
            logger.warning("kvwarden client: %s: re-registering", reason)
        self.recover(token)

    def recover(self, token: int, *, failure_is_outage: bool = True) -> bool:
        """Re-register now (against the server whose boot token is ``token``): healthy when it
        worked; when it failed, unhealthy unless ``failure_is_outage`` is false. Never raises."""
        ok = not self._stop.is_set() and self._recover()
        if ok:
            self.adopt(token)
        if ok or failure_is_outage:
            self.set_health(ok)
        return ok

    def set_health(self, healthy: bool) -> None:
        now = self._clock()
        with self._lock:
            was = self.healthy.is_set()
            since, self._unhealthy_since = self._unhealthy_since, None if healthy else now
            if not healthy and since is not None:
                self._unhealthy_since = since  # still the first failure
            if healthy:
                self.healthy.set()
            else:
                self.healthy.clear()
        if was != healthy:
            if healthy and since is not None:
                logger.info("kvwarden client: healthy again after %.1fs", now - since)
            else:
                logger.info("kvwarden client: %s", "healthy" if healthy else "unhealthy")
            if self._on_health_change is not None:
                self._on_health_change(healthy)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvwarden-heartbeat", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        t = self._thread
        if t is None:
            return True
        t.join(timeout_s)
        if t.is_alive():
            logger.error("kvwarden client: heartbeat thread still alive after %.1fs", timeout_s)
            return False
        return True
