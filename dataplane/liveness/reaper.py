"""The worker reaper: a thread that paces ``reap_once``, the pure step.

Every ``reap_timeout / 4`` it asks each liveness target to collect and pop the instances silent
past their window (``reap_timeout`` once they pinged, ``registration_grace`` before) and those
whose connection closed more than ``disconnect_grace`` ago, then sends them down the one release
path (`dataplane.liveness.release.InstanceReleaser`). Closed connections are reported by the
server loop (``note_closed``) and scanned here, never on the loop. ``_lock`` guards the pending
closes and disconnect deadlines only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dataplane.liveness.release import InstanceReleaser
from dataplane.liveness.target import InstanceLivenessTarget

logger = logging.getLogger(__name__)


class WorkerReaper:
    """The reaper thread: ``reap_once`` is the pure step; the thread only paces it.

    It runs every ``reap_timeout / 4`` and, while a disconnected instance waits out its grace,
    wakes at that deadline, so a dead peer goes within ``disconnect_grace`` plus one step.
    """

    def __init__(
        self,
        releaser: InstanceReleaser,
        reap_timeout_s: float,
        registration_grace_s: float,
        disconnect_grace_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not reap_timeout_s > 0:
            raise ValueError("the reaper needs a positive reap timeout")
        self.releaser = releaser
        self.reap_timeout_s = reap_timeout_s
        self.registration_grace_s = registration_grace_s
        self.disconnect_grace_s = disconnect_grace_s
        self.interval_s = reap_timeout_s / 4
        self._clock = clock
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._lock = threading.Lock()  # guards _disconnect_deadlines and _closed
        self._disconnect_deadlines: list[float] = []
        self._closed: list[tuple[int, float]] = []  # (fd, when) closes not yet marked
        self._thread: threading.Thread | None = None

    def reap_once(self) -> list[int]:
        """One cycle: every target collects and pops its stale and disconnected instances, and
        each goes down the one release path under its reason. Returns the reaped ids."""
        ids: list[int] = []
        for t in self.releaser.targets:  # one failing target never keeps the others reaped
            ids += self._reap(t, "stale")
            if self.disconnect_grace_s > 0:
                ids += self._reap(t, "disconnected")
        return ids

    def _reap(self, t: InstanceLivenessTarget, which: str) -> list[int]:
        """One reap of ``t``, and what it popped down the release path, by reason. Whatever a
        reap popped is released, even when another reap of ``t`` fails."""
        try:
            if which == "stale":
                reaped = t.reap_stale_instances(self.reap_timeout_s, self.registration_grace_s)
            else:
                reaped = t.reap_disconnected_instances(self.disconnect_grace_s)
        except Exception:
            logger.exception("reaper: reaping %s instances of %s failed", which, t.name)
            return []
        ids: list[int] = []
        for reason in dict.fromkeys(r.reason for r in reaped):
            group = [r.instance_id for r in reaped if r.reason == reason]
            self.releaser.release(group, reason, popped_by=t.name)
            ids += group
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
            for t in self.releaser.targets:
                try:
                    marked += t.mark_connection_closed(fd, now)
                except Exception:
                    logger.exception("reaper: marking fd %d closed failed", fd)
            if marked:
                logger.info(
                    "liveness: connection fd %d closed; %d instance(s) reaped in %.1fs unless they reconnect",
                    fd,
                    marked,
                    self.disconnect_grace_s,
                )
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
        self._thread = threading.Thread(target=self._run, name="kvwarden-worker-reaper", daemon=True)
        self._thread.start()
        logger.info(
            "reaper: started (timeout %.1fs, grace %.1fs, disconnect grace %.1fs, every %.1fs)",
            self.reap_timeout_s,
            self.registration_grace_s,
            self.disconnect_grace_s,
            self.interval_s,
        )

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
