"""Helpers of the L1 arena's tests (test_arena.py): sizes, the `Gate` that steers the fault-in
thread through ``yield_to``, a call on a thread of its own, and chunks put into an L1."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dataplane.memory import shm
from dataplane.storage.l1 import L1Store
from dataplane.storage.l1 import arena as arena_mod
from dataplane.storage.l1.arena import Arena

MiB = 1 << 20
SLICE = arena_mod._SLICE  # what the fault-in thread reserves per step
CAP = 4 * SLICE  # a shared arena of four slices
CHUNK = 4 * MiB  # four chunks fill one slice


# ---------------------------------------------------------------------------- helpers
class Gate:
    """A ``yield_to`` for the fault-in thread: it steps aside at every offset from ``upto`` on,
    and counts how often it was asked at each offset."""

    def __init__(self, upto: int = 0) -> None:
        self.upto = upto
        self._asked: dict[int, int] = {}
        self._lock = threading.Lock()

    def __call__(self, off: int) -> bool:
        with self._lock:
            self._asked[off] = self._asked.get(off, 0) + 1
        return off >= self.upto

    def asked(self, off: int) -> int:
        with self._lock:
            return self._asked.get(off, 0)

    def parked_at(self, off: int, times: int = 2) -> bool:
        """The thread has stepped aside at ``off`` (asked again after being told to wait)."""
        return self.asked(off) >= times


def allocated(path: Path) -> int:
    """Bytes of the file the filesystem has allocated (not its size)."""
    return os.stat(path).st_blocks * 512


def blocked_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is now inside ``function`` (somewhere on its stack)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


class Call:
    """``fn`` on a thread of its own; ``result`` once it returned."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # reported by join, not lost on the thread
            self.error = exc

    def join(self, timeout: float) -> object:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the call did not return within {timeout:g}s"
        if self.error is not None:
            raise self.error
        return self.result


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(l1: L1Store, i: int, nbytes: int = CHUNK) -> torch.Tensor:
    buf = l1.reserve(nbytes)
    assert buf is not None, f"reserve for chunk {i} refused"
    buf.fill_(i % 251)
    assert l1.commit(key(i), buf)
    return buf


def present(l1: L1Store, *ids: int) -> list[bool]:
    absent, held = l1.pin_present([key(i) for i in ids])
    l1.release(held)
    return [n not in absent for n in range(len(ids))]


def inside(a: Arena, buf: torch.Tensor) -> bool:
    base = a.region.data_ptr()
    return base <= buf.data_ptr() and buf.data_ptr() + buf.numel() <= base + a.capacity


def use_dir(monkeypatch: pytest.MonkeyPatch, d: Path) -> None:
    """Make ``d`` the segment directory (the arena keeps its own reference to it)."""
    monkeypatch.setattr(shm, "SHM_DIR", d)
    monkeypatch.setattr(arena_mod, "SHM_DIR", d)
