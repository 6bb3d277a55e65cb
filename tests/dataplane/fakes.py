"""Stand-in liveness targets shared by the liveness tests."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from dataplane.liveness.target import InstanceLivenessTarget


class BlendLike(InstanceLivenessTarget):
    """Per-instance side state and nothing else: only ``drop_instance_state`` is overridden."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self.state: dict[int, str] = {i: f"rope-{i}" for i in ids}
        self.dropped: list[int] = []
        self._lock = threading.Lock()  # guards state and dropped (the reaper thread writes)

    def drop_instance_state(self, instance_id: int) -> None:
        with self._lock:
            self.dropped.append(instance_id)
            self.state.pop(instance_id, None)

    def seen(self) -> list[int]:
        with self._lock:
            return list(self.dropped)
