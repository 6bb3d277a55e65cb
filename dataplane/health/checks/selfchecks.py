"""The data plane's own checks (loop thread, worker pools, reaper, ...): one per entry of
``Components.self_checks``, a function returning the problem (None while that part works).
Live checks (run whenever health is read, each a flag read) with the recompute policy: a data
plane that cannot serve is unhealthy."""

from __future__ import annotations

from collections.abc import Callable

from dataplane.health.base import Components, HealthCheck


class DataPlaneSelfCheck(HealthCheck):
    live = True

    def __init__(self, name: str, problem: Callable[[], str | None]) -> None:
        self._name, self._problem = name, problem
        self._reason = ""

    @classmethod
    def create(cls, components: Components) -> list[HealthCheck]:
        return [cls(name, fn) for name, fn in components.self_checks.items()]

    def name(self) -> str:
        return self._name

    def check(self) -> bool:
        problem = self._problem()
        self._reason = problem or ""
        return problem is None

    def reason(self) -> str:
        return self._reason
