"""The one release path: UNREGISTER, the reaper and the admin reap all end here.

``release(ids, reason)`` removes each id from every liveness target (running the UNREGISTER
cleanup where the id is still held), fans ``drop_instance_state`` out to every target, logs, and
counts the reaps by reason (``kvwarden_instances_reaped_total{reason}``; an UNREGISTER is not a
reap). ``_lock`` guards ``reaped_total`` only and is never held across a call into a target.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from dataplane.liveness.target import REAP_REASONS, InstanceLivenessTarget
from dataplane.metrics import DataPlaneMetrics

logger = logging.getLogger(__name__)


class InstanceReleaser:
    def __init__(self, targets: Sequence[InstanceLivenessTarget], metrics: DataPlaneMetrics) -> None:
        self.targets = list(targets)
        self._metrics = metrics
        self._lock = threading.Lock()  # guards reaped_total
        self._reaped_total = 0

    @property
    def reaped_total(self) -> int:
        with self._lock:
            return self._reaped_total

    def tracked_instance_count(self) -> int:
        return sum(t.tracked_instance_count() for t in self.targets)

    def release(
        self, ids: Sequence[int], reason: str, popped_by: str | None = None
    ) -> dict[int, tuple[str, ...]]:
        """Remove ``ids`` from every target, fan out ``drop_instance_state``, count the reaps.

        ``popped_by``: the target whose reap already collected and popped ``ids`` (its cleanup
        already runs). Returns, per id some target held, the names of those targets. An id no
        target held is not counted (an admin reap of an unknown id is a 404)."""
        # one shared tuple for the reaper's ids: a cycle of 1,000 allocates no container each
        out: dict[int, tuple[str, ...]] = dict.fromkeys(ids, (popped_by,)) if popped_by else {}
        for t in self.targets:
            if t.name == popped_by:
                continue
            for iid in self._remove_from(t, ids, reason):
                out[iid] = (*out.get(iid, ()), t.name)
        self._drop_state(ids)
        if popped_by is None:  # a reap was logged, with its silence, where it was collected
            for iid, names in out.items():
                logger.info("liveness: released instance %d (%s) from %s", iid, reason, ", ".join(names))
        if reason in REAP_REASONS and out:
            with self._lock:
                self._reaped_total += len(out)
            self._metrics.reaped.labels(reason=reason).inc(len(out))
        return out

    # ---------------------------------------------------------------- internals
    @staticmethod
    def _remove_from(t: InstanceLivenessTarget, ids: Sequence[int], reason: str) -> list[int]:
        try:
            return t.remove_instances(ids, reason)
        except Exception:  # one failing target never keeps the others from releasing
            logger.exception("liveness: %s failed to release %d instance(s)", t.name, len(ids))
            return []

    def _drop_state(self, ids: Sequence[int]) -> None:
        for t in self.targets:
            for iid in ids:
                try:
                    t.drop_instance_state(iid)
                except Exception:
                    logger.exception("liveness: %s: drop_instance_state(%d) failed", t.name, iid)
