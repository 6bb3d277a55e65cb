"""Tasks with the same key run one at a time, in order, on a shared pool (the transfers of one
instance). ``_lock`` guards the queues of waiting tasks only; a task never runs under it."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


class KeyedSerialExecutor:
    """Runs tasks on a pool so that tasks with the same key run one at a time, in order."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._lock = threading.Lock()  # guards _queues: key -> tasks waiting behind a running one
        self._queues: dict[int, deque[Callable[[], None]]] = {}

    def submit(self, key: int, task: Callable[[], None]) -> None:
        with self._lock:
            waiting = self._queues.get(key)
            if waiting is not None:
                waiting.append(task)
                return
            self._queues[key] = deque()
        self._pool.submit(self._drain, key, task)

    def busy(self, key: int) -> bool:
        """Whether a task with ``key`` is running or waiting."""
        with self._lock:
            return key in self._queues

    def _drain(self, key: int, task: Callable[[], None]) -> None:
        while True:
            task()
            with self._lock:
                waiting = self._queues[key]
                if not waiting:
                    del self._queues[key]
                    return
                task = waiting.popleft()
