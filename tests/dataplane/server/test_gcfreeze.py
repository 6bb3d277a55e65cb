"""CollectorFreezer: survivors of a full collection are frozen, garbage is not, and everything is
handed back to the collector every refresh period (its clock injected)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import pytest

from dataplane.server.gcfreeze import CollectorFreezer
from tests.helpers import wait_until


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def _until(cond: Callable[[], bool], what: str) -> None:
    wait_until(cond, 10, interval=0.005, what=what)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


@pytest.fixture
def freezer(clock: _Clock) -> Iterator[CollectorFreezer]:
    f = CollectorFreezer(refresh_s=60.0, clock=clock)
    f.start()
    try:
        yield f
    finally:
        f.stop()
        f.join(10)
        gc.unfreeze()  # the test process's objects back where they were


def test_start_freezes_what_is_loaded(freezer: CollectorFreezer) -> None:
    assert gc.get_freeze_count() > 1000
    assert freezer.counts() == (1, 0) and freezer.is_alive()


def test_survivors_of_a_full_collection_are_frozen_and_garbage_is_not(freezer: CollectorFreezer) -> None:
    kept = [{"i": [i]} for i in range(5000)]  # tracked objects that live on
    dead = _Node()
    dead_ref = weakref.ref(dead)
    del dead
    before = gc.get_freeze_count()
    gc.collect()
    _until(lambda: freezer.counts()[0] == 2, "the freeze after a full collection")
    assert dead_ref() is None  # the cycle was freed by the pass, not frozen
    assert gc.get_freeze_count() >= before + len(kept)
    assert gc.get_count()[2] == 0 and len(gc.get_objects(generation=2)) < 100  # nothing left to walk


def test_young_collections_do_not_freeze(freezer: CollectorFreezer) -> None:
    for _ in range(3):
        gc.collect(0)
        gc.collect(1)
    # the callback only flags a full pass: nothing flagged, nothing frozen (flagged and not yet
    # handled would show as the event; handled, as the count)
    assert not freezer._wake.is_set() and freezer.counts() == (1, 0)
    gc.collect()
    _until(lambda: freezer.counts()[0] == 2, "the freeze after the full collection")


def test_refresh_hands_everything_back_so_a_frozen_cycle_is_freed(
    freezer: CollectorFreezer, clock: _Clock
) -> None:
    node = _Node()
    ref = weakref.ref(node)
    gc.collect()
    _until(lambda: freezer.counts()[0] == 2, "the freeze")
    del node  # garbage now, but frozen: a full pass does not see it
    gc.collect()
    _until(lambda: freezer.counts()[0] == 3, "the next freeze")
    assert ref() is not None
    clock.now += 60.0  # the refresh period is over
    gc.collect()  # wakes the freezer: it freezes, then thaws everything (the refresh)
    _until(lambda: freezer.counts()[1] == 1, "the refresh")
    assert gc.get_freeze_count() == 0
    gc.collect()  # the full pass after a refresh walks everything once and frees the cycle
    assert ref() is None


def test_stop_removes_the_callback_and_a_bad_period_is_refused(clock: _Clock) -> None:
    f = CollectorFreezer(refresh_s=60.0, clock=clock)
    f.start()
    with pytest.raises(RuntimeError, match="already started"):
        f.start()
    f.stop()
    f.join(10)
    gc.unfreeze()
    assert not f.is_alive() and all(cb != f._on_collect for cb in gc.callbacks)
    with pytest.raises(ValueError, match="refresh_s must be > 0"):
        CollectorFreezer(refresh_s=0)
