"""What the two lower tiers (the file tier, the remote tier) report alike: the codes of their
health pings, why a write is dropped, the buckets of their call durations, and `WriteSpace`,
their out-of-space episodes.

**Out of space is not an outage.** A disk that is full (ENOSPC, EDQUOT) or a Redis that answers
OOM (``maxmemory`` with ``noeviction``) still answers at once: nothing waits on it, and what it
holds can still be read. So a tier out of space stops writing (what cannot be written is
dropped, counted ``no_space``), keeps serving what it holds, and stays healthy, reported as
degraded (``warn``) with the reason; L1 serves as before. `WriteSpace` is one such episode: it
starts at the first write (or probe) refused for want of space, logs one warning, and ends when
the tier sees room again (its own eviction, a health round's probe that finds room for the
write that failed, or a write let through as a try at most once a second, when the store shows
room for it, that lands), with one line saying so. Only what can stall or corrupt (a call past its
deadline, EIO, a vanished or read-only directory, no connection) fails a tier's health check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

OK, TIMEOUT, OTHER_ERROR = 0, -1, -2  # ping error codes (the health spec's)
# why a write was dropped: its queue was full, its tier bypassed (local_cpu), the tier stopping,
# or its store out of space (`WriteSpace`)
DROP_REASONS = ("full", "bypassed", "stopped", "no_space")
# upper bounds (seconds) of the lower tiers' call-duration buckets (a histogram's, +Inf after them)
DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
OPS = ("get", "exists", "put")  # a read; a LOOKUP's check of what is held; a write
# while out of space, one write at most this often is let through as a try, if the store shows
# room for it: writes resume within a second of space freeing, not a health round later
TRY_S = 1.0
Admission = Literal["write", "try", "drop"]  # `WriteSpace.admit`


@dataclass(frozen=True, slots=True)
class SpaceState:
    """A tier's writes as `WriteSpace.state` reads them."""

    out_of_space: bool
    reason: str  # what refused the write that started the episode ("" when there is room)
    seconds: float  # how long the episode has lasted (0 when there is room)
    episodes: int  # episodes since start, the current one included
    dropped: int  # writes dropped for want of space in the current (or last) episode

    def describe(self) -> str:
        """The health check's reason while out of space ("" while there is room)."""
        if not self.out_of_space:
            return ""
        return (
            f"out of space for {self.seconds:.0f} s ({self.reason}): writes stopped, "
            f"{self.dropped} dropped; reads go on"
        )


class WriteSpace:
    """Whether a tier's store has room for writes, as episodes (see the module's docstring).

    ``ran_out`` starts (or continues) an episode; ``freed`` ends it; ``out`` is read by every
    write, which is dropped while it holds, but for one every `TRY_S` (``admit``). ``need`` is
    the size of the write that did not fit:
    a probe finds room only when that much is free, so a store with a little room left does not
    flap between writing and refusing every round.
    """

    def __init__(self, tier: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier  # how its log lines name the tier
        self._clock = clock
        self._lock = threading.Lock()  # leaf: guards every field below
        self._since: float | None = None  # when the current episode started (None: room)
        self._reason = ""
        self._need = 0
        self._episodes = 0
        self._dropped = 0
        self._tried = float("-inf")  # when a write was last let through as a try

    @property
    def out(self) -> bool:
        with self._lock:
            return self._since is not None

    def need(self) -> int:
        """Bytes the write that started the episode needed (0: unknown, or no episode)."""
        with self._lock:
            return self._need if self._since is not None else 0

    def ran_out(self, reason: str, need: int = 0) -> None:
        """A write (or a probe) of ``need`` bytes was refused for want of space: writes stop."""
        with self._lock:
            first = self._since is None
            if first:
                self._since, self._reason, self._dropped = self._clock(), reason, 0
                self._episodes += 1
            self._need = max(self._need if not first else 0, need)
        if first:
            logger.warning(
                "%s: out of space (%s): writes stop and are counted as dropped until space frees; "
                "what it holds is still served",
                self.tier,
                reason,
            )

    def admit(self) -> Admission:
        """What becomes of a write offered now, in one look: ``write`` (there is room), ``try``
        (out of space, and no write has been let through as a try for `TRY_S`: this one goes)
        or ``drop``."""
        with self._lock:
            if self._since is None:
                return "write"
            now = self._clock()
            if now - self._tried < TRY_S:
                return "drop"
            self._tried = now
            return "try"

    def dropped(self) -> None:
        """A write dropped for want of space (counted for the line that ends the episode)."""
        with self._lock:
            self._dropped += 1

    def freed(self, why: str) -> bool:
        """Room again (``why``: what showed it): writes resume. False when there was no episode."""
        with self._lock:
            if self._since is None:
                return False
            lasted, dropped = self._clock() - self._since, self._dropped
            self._since, self._reason, self._need = None, "", 0
        logger.info(
            "%s: writes resume (%s) after %.1f s out of space, %d writes dropped",
            self.tier,
            why,
            lasted,
            dropped,
        )
        return True

    def state(self) -> SpaceState:
        with self._lock:
            since = self._since
            seconds = 0.0 if since is None else max(0.0, self._clock() - since)
            return SpaceState(since is not None, self._reason, seconds, self._episodes, self._dropped)
