"""`Coalescer`: shared builds, answers never older than the request, a bounded duty cycle."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.core.coalesce import Coalescer
from tests.helpers import wait_until


def test_sequential_callers_each_get_a_fresh_build() -> None:
    counter = iter(range(100))
    c = Coalescer(lambda: next(counter), max_duty=1.0)
    assert [c.get() for _ in range(3)] == [0, 1, 2]
    assert c.builds == 3


def test_callers_during_a_build_share_the_next_one() -> None:
    release = threading.Event()
    arrivals: set[str] = set()
    lock = threading.Lock()
    n_builds = iter(range(100))

    def clock() -> float:
        with lock:
            arrivals.add(threading.current_thread().name)
        return time.monotonic()

    def build() -> int:
        n = next(n_builds)
        if n == 0:
            assert release.wait(30)
        return n

    c = Coalescer(build, max_duty=1.0, clock=clock)
    with ThreadPoolExecutor(8, thread_name_prefix="caller") as pool:
        first = pool.submit(c.get)
        wait_until(lambda: c._building, 10, what="the first build to start")
        with lock:
            arrivals.clear()
        rest = [pool.submit(c.get) for _ in range(7)]
        wait_until(lambda: len(arrivals) >= 7, 10, what="seven callers waiting")
        release.set()
        assert first.result(30) == 0
        # they arrived after build 0 started: it is too old for them; one build serves all 7
        assert [f.result(30) for f in rest] == [1] * 7
    assert c.builds == 2


def test_when_requests_outpace_builds_builds_take_at_most_max_duty() -> None:
    """Build 0 takes 0.2 s (simulated on a skewed clock) while a caller waits: at 50 % duty the
    waiter's build starts 0.2 s after build 0 ended (read on the coalescer's own clock)."""
    skew = [0.0]
    release = threading.Event()
    n_builds = iter(range(100))
    seen: dict[str, float] = {}  # build 0's end and build 1's start, on the injected clock

    def clock() -> float:
        return time.monotonic() + skew[0]

    def build() -> int:
        n = next(n_builds)
        if n == 0:
            assert release.wait(30)
            skew[0] += 0.2
            seen["end0"] = clock()
        else:
            seen["start1"] = clock()
        return n

    c = Coalescer(build, max_duty=0.5, clock=clock, cost=clock)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(c.get)
        wait_until(lambda: c._building, 10, what="the first build to start")
        waiter = pool.submit(c.get)
        wait_until(lambda: c._waiting == 1, 10, what="a caller waiting")
        release.set()
        assert first.result(30) == 0
        assert waiter.result(30) == 1
    assert c.builds == 2
    # the gate: build 0's cost (>= 0.2 on this clock) x (1 / 0.5 - 1) after it ended; build 1
    # started past it (the clock only moves forward: no machine makes this fail)
    assert c._next_start >= seen["end0"] + 0.2 - 1e-9, (c._next_start, seen)
    assert seen["start1"] >= c._next_start, (c._next_start, seen)


def test_a_lone_caller_is_never_held_back() -> None:
    skew = [0.0]

    def clock() -> float:
        return time.monotonic() + skew[0]

    def build() -> float:
        skew[0] += 60.0  # a "minute-long" build: a gate would hold the next call 3 minutes
        return clock()

    c = Coalescer(build, max_duty=0.25, clock=clock, cost=clock)
    first = c.get()
    # nobody waited as the build ended: no gate was set, so the next call builds at once
    assert c._next_start == float("-inf")
    assert c.get() > first  # a fresh build (it read the clock after the first)
    assert c.builds == 2
    assert c._next_start == float("-inf")


def test_a_failed_build_raises_to_its_caller_and_the_next_caller_builds_again() -> None:
    outcomes = iter([RuntimeError("boom"), 7])

    def build() -> int:
        o = next(outcomes)
        if isinstance(o, Exception):
            raise o
        return o

    c = Coalescer(build, max_duty=1.0)
    with pytest.raises(RuntimeError, match="boom"):
        c.get()
    assert c.get() == 7


def test_max_duty_is_validated() -> None:
    for bad in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="max_duty"):
            Coalescer(lambda: 1, max_duty=bad)


def test_time_a_build_spends_waiting_is_no_cost() -> None:
    """A build that waits (for the GIL, here for an event) costs its CPU time only: the next
    build is not held back three times the wait (a wall-time gate would hold it 0.9 s)."""
    release = threading.Event()
    n_builds = itertools.count()
    skew = [0.0]  # the wall clock the coalescer reads runs 0.3 s ahead once the first build waited
    builder: list[int] = []  # build 0's thread
    built = threading.Event()  # set as build 0 returns
    finished: list[float] = []  # the coalescer's first clock read on that thread after it returned

    def clock() -> float:
        t = time.monotonic() + skew[0]
        if built.is_set() and not finished and threading.get_ident() == builder[0]:
            finished.append(t)
        return t

    def build() -> int:
        n = next(n_builds)
        if n == 0:
            builder.append(threading.get_ident())
            assert release.wait(30)
            skew[0] += 0.3  # the build's wait: wall time that costs no CPU (this is what is measured)
            built.set()
        return n

    # the default cost: the building thread's CPU time
    c = Coalescer(build, max_duty=0.25, clock=clock)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(c.get)
        wait_until(lambda: c._building, 10, what="the first build to start")
        waiter = pool.submit(c.get)
        wait_until(lambda: c._waiting == 1, 10, what="a caller waiting")
        release.set()
        assert first.result(30) == 0
        assert waiter.result(30) == 1
    # the rest set after build 0 is 3x its CPU time (a thread blocked on an event spends next to
    # none), not 3x its 0.3 s of wall time: a wall-time gate would be >= 0.9 on this clock
    rest = c._next_start - finished[0]
    assert 0 <= rest < 0.9, rest
