"""Compiling numba kernels off the hot path: `CompileWarmup` compiles (or loads from numba's
cache) a set of kernels once on a thread of its own and publishes them in a registry the
callers read; until then, and where numba fails, the callers keep their numpy or torch path."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class CompileWarmup:
    """Compiles ``compile()``'s kernels into ``registry`` on thread ``thread_name``, once a
    process: ``start`` (idempotent) begins, ``ready`` says they can be used, ``state`` is
    "idle", "compiling", "ready" or "unavailable: <why>" (numba missing or failing: the callers
    keep ``fallback``, said once in the log). ``_lock`` guards ``_thread`` and ``_state``."""

    def __init__(
        self,
        registry: dict[str, Any],
        compile: Callable[[], dict[str, Any]],
        thread_name: str,
        what: str,
        fallback: str,
    ) -> None:
        self._registry = registry
        self._compile = compile
        self._thread_name = thread_name
        self._what = what
        self._fallback = fallback
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._state = "ready" if registry else "idle"

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        with self._lock:
            if self._state != "idle":
                return
            self._state = "compiling"
            self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
            self._thread.start()

    def stop(self) -> None:
        return None  # a compile cannot be interrupted; join() waits for it

    def join(self, timeout: float | None = None) -> None:
        with self._lock:
            t = self._thread
        if t is not None:
            t.join(timeout)

    def _run(self) -> None:
        try:
            if not self._registry:
                self._registry.update(self._compile())
            state = "ready"
            logger.info("%s ready", self._what)
        except Exception as exc:  # any failure leaves the fallback, said once
            state = f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logger.warning("%s %s; %s", self._what, state, self._fallback)
        with self._lock:
            self._state = state
