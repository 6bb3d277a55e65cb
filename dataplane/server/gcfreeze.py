"""Keep long-lived objects out of the cyclic collector's full passes.

A full (generation 2) collection walks every tracked object with the GIL held. A server holds
about a dozen tracked objects per registered instance (its mapping, tensors, records), so at
10,000 instances one full pass took 35-60 ms: every thread stalls, PING and `/status` alike.
The objects an instance holds live as long as its registration, so walking them again and again
finds nothing.

`CollectorFreezer` moves what survived each full collection into the permanent generation
(`gc.freeze`): the next full pass walks only what was created since. Freezing right after a full
pass leaks nothing: everything still unreachable has just been freed. What later becomes garbage
among frozen objects is freed by reference counting as usual; only a reference cycle among them
would wait, so every ``refresh_s`` the freezer thaws everything (`gc.unfreeze`), and the next
full pass walks it all once, frees such cycles, and the freezer freezes the survivors again.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

# How often everything frozen is handed back to the collector (see the module docstring): one
# full walk of the live objects (~50 ms at 10,000 instances) each time.
REFRESH_S = 600.0


class CollectorFreezer:
    """Freezes the survivors of every full collection (thread ``kvwarden-gc-freeze``)."""

    def __init__(self, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.refresh_s = refresh_s
        self._clock = clock
        self._wake = threading.Event()  # set by the collector callback: a full pass just ended
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # leaf: guards the counters below
        self.freezes = 0
        self.refreshes = 0
        self._thawed_at = 0.0

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Freeze what is loaded now (modules, the app: it lives as long as the process), then
        watch for full collections."""
        if self._thread is not None:
            raise RuntimeError("CollectorFreezer already started")
        self._thawed_at = self._clock()
        self._freeze()
        gc.callbacks.append(self._on_collect)
        self._thread = threading.Thread(target=self._run, name="kvwarden-gc-freeze", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # --------------------------------------------------------------- workings
    def _on_collect(self, phase: str, info: dict[str, Any]) -> None:
        # runs inside the collector, on whichever thread triggered it: only flag the thread
        if phase == "stop" and info.get("generation") == 2:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.refresh_s)
            if self._stop.is_set():
                return
            if self._wake.is_set():
                self._wake.clear()
                self._freeze()
            if self._clock() - self._thawed_at >= self.refresh_s:
                self._thaw()

    def _freeze(self) -> None:
        gc.freeze()
        with self._lock:
            self.freezes += 1

    def _thaw(self) -> None:
        """Everything back to the oldest generation: the next full pass walks it all once."""
        gc.unfreeze()
        with self._lock:
            self.refreshes += 1
            self._thawed_at = self._clock()

    def counts(self) -> tuple[int, int]:
        """(freezes, refreshes) so far."""
        with self._lock:
            return self.freezes, self.refreshes
