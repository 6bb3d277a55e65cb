"""``OutageLog``: a worker's count of transfers answered as misses, and the two lines that
bracket each outage: one WARNING at its first miss, one INFO line at the first transfer the
server answers after it. ``_lock`` guards ``misses`` and ``_outage``."""

from __future__ import annotations

import logging
import threading
import time


class OutageLog:
    """Misses and outages of one adapter, logged on ``logger`` (the adapter's)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._lock = threading.Lock()  # guards misses and _outage
        self.misses = 0  # transfers answered with the outage answer
        self._outage: tuple[float, int] | None = None  # (start, misses before it) while missing

    def missed(self, why: str) -> None:
        """Count a miss; the first of an outage logs one WARNING."""
        with self._lock:
            first = self._outage is None
            if first:
                self._outage = (time.monotonic(), self.misses)
            self.misses += 1
        if first:
            self._logger.warning(
                "kvwarden client: transfers answer as misses until the server is back (%s)", why
            )

    def served(self) -> None:
        """A transfer the server answered: the end of an outage, if there was one."""
        with self._lock:
            outage, self._outage = self._outage, None
            missed = self.misses - outage[1] if outage is not None else 0
        if outage is not None:
            self._logger.info(
                "kvwarden client: transfers served again after %d misses in %.1fs",
                missed,
                time.monotonic() - outage[0],
            )
