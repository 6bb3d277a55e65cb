"""What the connector did since vLLM last asked: its lookups, loads and stores, counted on the
scheduler and on each worker, handed to vLLM's connector stats (`vllm_stats`), which its
``/metrics`` shows as ``vllm:kvwarden_*``.

``_lock`` guards ``_counts`` and ``_load_s`` (the step thread, the loader and saver threads
add; vLLM's step takes); it is a leaf lock.
"""

from __future__ import annotations

import threading
from typing import Any

COUNTERS = (
    "lookups_hit",  # requests the scheduler found a prefix for (kvwarden loads it)
    "lookups_miss",  # requests the server held nothing of
    "lookups_unanswered",  # requests the server could not be asked about (down: recompute)
    "loads_full",  # loads that brought every token planned
    "loads_short",  # loads cut short (the rest recomputed)
    "loaded_tokens",
    "loaded_bytes",
    "stored_chunks",  # chunks written to the server (not those it held already)
    "stored_bytes",
    "failed_stores",  # stores that failed (the server down, refused)
)
MAX_SAMPLES = 4096  # load times kept between two takes (vLLM takes every step)


class Tally:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _counts, _load_s
        self._counts: dict[str, int] = {}
        self._load_s: list[float] = []

    def add(self, **counts: int) -> None:
        """Count ``counts`` (names of `COUNTERS`)."""
        for name in counts:
            if name not in COUNTERS:
                raise ValueError(f"unknown counter {name!r}")
        with self._lock:
            for name, n in counts.items():
                if n:
                    self._counts[name] = self._counts.get(name, 0) + n

    def load_took(self, seconds: float) -> None:
        with self._lock:
            if len(self._load_s) < MAX_SAMPLES:
                self._load_s.append(seconds)

    def take(self) -> dict[str, Any] | None:
        """What was counted since the last take (``{"counts": {...}, "load_s": [...]}``), and a
        fresh start; None when nothing was."""
        with self._lock:
            if not self._counts and not self._load_s:
                return None
            out = {"counts": self._counts, "load_s": self._load_s}
            self._counts, self._load_s = {}, []
        return out
