"""`Coalescer`: one build at a time, shared by concurrent callers, with a bounded duty cycle.

`/status` and `/instances` copy every tracked instance out of the data plane. That work shares
the process (and its GIL) with the data-plane loop, and each copy holds a module lock for its
duration, so a flood of requests must not turn into a flood of copies:

- at most one build runs at a time; callers that arrive meanwhile wait for it to end;
- a caller only ever gets a result whose build *started after it called*, so an answer is never
  older than its request (read-your-writes: a reap followed by `/status` never shows the
  reaped instance);
- when callers were already waiting as a build ended (requests outpace builds), the next build
  starts no sooner than ``d * (1 / max_duty - 1)`` after it (``d``: the build's cost, the CPU
  time of the thread that built, by default), so builds take at most ``max_duty`` of one core
  however many requests arrive; every caller waiting at that moment shares the next build. The
  cost is CPU time, not wall time: a build hands the GIL over to the data-plane loop again and
  again, and the time it then waits for the GIL is no cost. A lone caller (nobody waiting) is never held
  back, so a client polling one request at a time sees the plain build time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Coalescer(Generic[T]):
    def __init__(
        self,
        build: Callable[[], T],
        max_duty: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        cost: Callable[[], float] = time.thread_time,
    ) -> None:
        if not 0 < max_duty <= 1:
            raise ValueError("max_duty must be in (0, 1]")
        self._build = build
        self._rest_factor = 1.0 / max_duty - 1.0
        self._clock = clock
        self._cost = cost  # what a build costs: read before and after it, on the building thread
        # guards every field below; never held while building
        self._cond = threading.Condition(threading.Lock())
        self._building = False
        self._waiting = 0  # callers inside get() that found no usable result yet
        self._result: T | None = None
        self._result_started = float("-inf")  # when the build of _result started
        self._next_start = float("-inf")  # the duty-cycle gate
        self.builds = 0  # how many builds ran (for tests and operators)

    def get(self) -> T:
        arrived = self._clock()
        with self._cond:
            self._waiting += 1
            try:
                while True:
                    if self._result is not None and self._result_started >= arrived:
                        return self._result
                    if not self._building:
                        wait = self._next_start - self._clock()
                        if wait <= 0:
                            self._building = True
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
            finally:
                self._waiting -= 1
        started = self._clock()
        spent = self._cost()
        try:
            result = self._build()
        except BaseException:
            with self._cond:
                self._building = False
                self._cond.notify_all()
            raise
        finished, spent = self._clock(), self._cost() - spent
        with self._cond:
            self._result, self._result_started = result, started
            self._building = False
            if self._waiting:  # requests outpace builds: rest before the next one
                self._next_start = finished + spent * self._rest_factor
            self.builds += 1
            self._cond.notify_all()
        return result
